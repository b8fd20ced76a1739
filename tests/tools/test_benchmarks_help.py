"""`python -m benchmarks --help` and every suite's `--help` print their text (a `%` in a suite's
docstring once made argparse raise instead)."""
from __future__ import annotations

import pytest

from benchmarks.__main__ import SUITES, main


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in SUITES])
def test_help_prints(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: python -m benchmarks" in capsys.readouterr().out
