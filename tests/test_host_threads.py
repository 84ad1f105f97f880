"""Importing cascadia keeps numpy's BLAS to one thread (OpenVINO owns the cores), unless the user chose."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("given, expected", [(None, "1"), ("3", "3")])
def test_importing_cascadia_sets_one_blas_thread_unless_the_user_chose(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    code = "import cascadia, os; print(os.environ['OPENBLAS_NUM_THREADS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
