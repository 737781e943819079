"""Every numeric flag walked with NaN, inf, negative, zero and out-of-range values (issue 30 §1).

The flags are enumerated from the parser itself: a new flag parsed as a number without a domain in
:mod:`megazero.config.domains` fails ``test_every_numeric_flag_has_a_domain``. For each domain the
values just outside it must stop the run before any work with the domain's one line naming the
flag, and its closed ends must not be refused.
"""

from __future__ import annotations

import math

import pytest

from megazero.arguments import parse_args
from megazero.config.domains import DOMAINS, NOT_NUMERIC, domain_problem, parse_interval
from megazero.config.flags import build_parser, int_like


def numeric_actions() -> dict:
    """dest -> the argparse action of every flag parsed as a number."""
    return {a.dest: a for a in build_parser("t")._actions
            if a.option_strings and a.type in (int, float, int_like)}


ACTIONS = numeric_actions()


def flag_of(dest: str) -> str:
    return ACTIONS[dest].option_strings[0]


def outside(dest: str) -> list[str]:
    """The values a user may type that the domain excludes (as text)."""
    lo, hi, lo_closed, hi_closed = parse_interval(DOMAINS[dest])
    values = [lo - 1 if lo_closed else lo]
    if lo > 0:
        values.append(0)
    if math.isfinite(hi):
        values.append(hi + 1 if hi_closed else hi)
    values.append(-1)
    text = [str(int(v)) if ACTIONS[dest].type is not float else repr(float(v)) for v in values]
    if ACTIONS[dest].type is float:
        text += ["nan", "inf", "-inf"]
    return list(dict.fromkeys(text))


def run(argv: list[str], capsys) -> tuple[int, str]:
    """Parse ``argv`` (world size 1, not a training run): (exit status, stderr)."""
    try:
        parse_args(argv, world_size=1, prog="pretrain_gpt.py")
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


def test_every_numeric_flag_has_a_domain():
    missing = sorted(set(ACTIONS) - set(DOMAINS) - NOT_NUMERIC)
    assert not missing, f"numeric flags without a domain in megazero/config/domains.py: {missing}"
    assert not sorted(set(DOMAINS) - set(ACTIONS)), "domains of flags the parser does not have"
    assert len(ACTIONS) > 60


CASES = [(dest, value) for dest in sorted(DOMAINS) for value in outside(dest)]


@pytest.mark.parametrize("dest,value", CASES, ids=[f"{d}={v}" for d, v in CASES])
def test_a_value_outside_the_domain_stops_the_run_naming_the_flag(dest, value, capsys):
    flag = flag_of(dest)
    code, err = run([f"{flag}={value}"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), err
    if ACTIONS[dest].type is float or value.lstrip("-").isdigit():
        parse = ACTIONS[dest].type if ACTIONS[dest].type is not int_like else int
        expected = domain_problem(flag, parse(value), DOMAINS[dest])
        assert expected and expected in lines[0], (expected, err)
    else:  # "nan" for an integer flag: argparse's own message names the flag
        assert flag in lines[0]


@pytest.mark.parametrize("dest", sorted(DOMAINS))
def test_the_closed_ends_of_each_domain_are_accepted(dest, capsys):
    lo, hi, lo_closed, hi_closed = parse_interval(DOMAINS[dest])
    flag = flag_of(dest)
    for bound in [v for v, closed in ((lo, lo_closed), (hi, hi_closed)) if closed and math.isfinite(v)]:
        value = str(int(bound)) if ACTIONS[dest].type is not float else repr(float(bound))
        code, err = run([f"{flag}={value}"], capsys)
        assert f"{flag} must be" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--attention-dropout", "-0.1"], "--attention-dropout must be in [0, 1), got -0.1"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), got 1.5"),
    (["--adam-eps=-1e-8"], "--adam-eps must be >= 0, got -1e-08"),
    (["--norm-epsilon", "-1"], "--norm-epsilon must be >= 0, got -1.0"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1, got 0"),
    (["--kv-channels", "0"], "--kv-channels must be >= 1, got 0"),
    (["--init-method-std", "-0.02"], "--init-method-std must be >= 0, got -0.02"),
    (["--seed", "-1"], "--seed must be in [0, 2147483648), got -1"),
    (["--distributed-timeout-minutes", "-1"], "--distributed-timeout-minutes must be > 0, got -1.0"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0, got 0.0"),
    (["--split", "nan,1,1", "--data-path", "x"], "--split 'nan,1,1': expected up to three finite non-negative weights"),
    (["--step-batch-size-schedule", "0:inf"], "--step-batch-size-schedule '0:inf': 'INF' is not a finite number"),
    (["--moe-aux-loss-coeff", "0.01", "nan"], "--moe-aux-loss-coeff must be a finite number >= 0, got nan"),
])
def test_the_issue_s_examples_get_one_line_naming_the_flag(argv, message, capsys):
    code, err = run(argv, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
