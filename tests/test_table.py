from cascadia.table import format_rows


def test_columns_are_as_wide_as_their_widest_cell_and_numbers_align_right():
    rows = [("node", "layers", "ms"), ("n0", "0-10", "1.5"), ("node-b", "11-12", "12.25")]
    assert format_rows(rows, left={0, 1}).splitlines() == [
        "node    layers     ms",
        "n0      0-10      1.5",
        "node-b  11-12   12.25",
    ]


def test_no_line_ends_in_spaces():
    rows = [("streams", "busiest node"), ("2", "node-b 90%"), ("3", "-"), ("", "")]
    assert format_rows(rows, left={1}).split("\n") == ["streams  busiest node", "      2  node-b 90%", "      3  -", ""]
