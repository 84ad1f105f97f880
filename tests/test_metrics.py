import json

import pytest

from cascadia.metrics import SCHEMA, Recorder, RequestRecord, format_table, result, summarize_level
from cascadia.models.inkling import InklingConfig
from cascadia.policy import Admitted, Finished, Rejected, Request, Token, Verified
from cascadia.spec.types import ClusterSpec, ModelSpec, NodeSpec, Spec


def record(request_id, t_arrival, token_times, prompt=4):
    return RequestRecord(1, None, "measured", request_id, prompt, len(token_times), t_arrival, token_times[0],
                         token_times[-1], tuple(token_times))


def test_recorder_turns_events_into_records():
    rec = Recorder(level=2, phase="measured")
    rec.arrived(Request(5, (1, 2, 3), 3), 0.5)
    rec.arrived(Request(6, (1,), 1), 0.5)
    rec.observe([Admitted(5, 0, 0), Rejected(6, "too long")], 0.5)
    rec.observe([Token(5, 9, 0)], 1.0)
    rec.observe([Token(5, 9, 1)], 1.25)
    rec.observe([Token(5, 9, 2), Finished(5, 0, "length", 3)], 1.75)
    assert rec.records == [RequestRecord(2, None, "measured", 5, 3, 3, 0.5, 1.0, 1.75, (1.0, 1.25, 1.75))]
    assert rec.rejected == [Rejected(6, "too long")]
    assert rec.records[0].ttft == 0.5 and rec.records[0].tpot == pytest.approx(0.375)


def test_level_summary():
    records = [
        record(0, 0.0, [1.0, 2.0, 3.0]),  # decodes over [1, 3]
        record(1, 0.0, [2.0, 4.0]),  # decodes over [2, 4]: overlaps, so decoding time is [1, 4] = 3 s
        record(2, 5.0, [6.0, 10.0]),  # [6, 10]: 4 s more, the gap [4, 6] is not decoding time
        record(3, 5.0, [7.0]),  # a single token: no decode tokens, no TPOT
    ]
    s = summarize_level(records, {"a": 5.0, "b": 2.5}, concurrency=4, rejected=1)
    assert s["requests"] == 4 and s["rejected"] == 1 and s["output_tokens"] == 8
    assert s["decode_tokens_per_s"] == pytest.approx(4 / 7)  # 2 + 1 + 1 decode tokens over 3 + 4 s
    assert s["wall_s"] == 10.0 and s["phase_tokens_per_s"] == pytest.approx(0.8)
    # ttft 1, 2, 1, 2 -> linear-interpolated percentiles
    assert s["ttft_s"] == {"p50": pytest.approx(1.5), "p95": pytest.approx(2.0), "p99": pytest.approx(2.0)}
    # tpot 1, 2, 4 -> p50 2, p95 and p99 between 2 and 4: 2 + 0.9 * 2, 2 + 0.98 * 2
    assert s["tpot_s"] == {"p50": pytest.approx(2.0), "p95": pytest.approx(3.8), "p99": pytest.approx(3.96)}
    assert s["busy"] == {"a": 0.5, "b": 0.25}


def test_speculation_counts_each_verifying_step():
    rec = Recorder(level=1, phase="measured")
    rec.arrived(Request(5, (1, 2, 3), 6), 0.0)
    rec.observe([Token(5, 9, 0)], 1.0)
    rec.observe([Token(5, 9, 1), Token(5, 9, 2), Token(5, 9, 3), Verified(5, 4, 2)], 2.0)
    rec.observe([Token(5, 9, 4), Verified(5, 3, 0), Token(5, 9, 5), Finished(5, 0, "length", 6)], 3.0)
    s = summarize_level(rec.records, {}, concurrency=1, speculation=rec.speculation)
    assert s["speculation"] == {"proposed": 7, "accepted": 2, "mean_accepted_per_step": 1.0}
    assert "2/7 (1.00/step)" in format_table({"levels": [s]})
    assert summarize_level(rec.records, {})["speculation"] == {"proposed": 0, "accepted": 0,
                                                               "mean_accepted_per_step": None}


def test_single_token_requests_have_no_decode_rate():
    s = summarize_level([record(0, 0.0, [1.0])], {}, concurrency=1)
    assert s["decode_tokens_per_s"] is None and s["tpot_s"] == {"p50": None, "p95": None, "p99": None}
    assert s["phase_tokens_per_s"] == 1.0


def tiny_spec():
    config = InklingConfig.from_hf_dict({"num_hidden_layers": 2, "hidden_size": 16, "vocab_size": 32})
    return Spec(ModelSpec(config, name="tiny"), ClusterSpec((NodeSpec("a", memory_bytes=2**30),)))


def test_result_schema_and_table():
    records = [record(0, 0.0, [0.5, 0.75, 1.0]), record(1, 0.0, [0.25])]
    level = summarize_level(records, {"node-a": 0.5, "node-b": 0.9}, concurrency=2)
    out = result("simulate", tiny_spec(), [level], records, calibration={"kind": "analytic"})
    assert out["schema"] == SCHEMA and out["source"] == "simulate"
    assert out["spec"]["model"]["name"] == "tiny" and out["calibration"] == {"kind": "analytic"}
    assert out["requests"][0]["token_times"] == (0.5, 0.75, 1.0)
    json.dumps(out)  # plain data all the way down
    lines = format_table(out).splitlines()
    assert lines[0].split()[:3] == ["streams", "requests", "tokens"]
    # decode: 2 tokens over 0.5 s; phase: 4 tokens over 1 s; busiest node over the 1 s phase
    assert lines[1].split() == ["2", "2", "4", "4.00", "4.00", "375.0", "487.5", "250.0", "250.0", "node-b", "90%"]
    end = lines[0].index("decode tok/s") + len("decode tok/s")
    assert lines[1][end - 4:end] == "4.00"  # numbers are right-aligned under their headers
