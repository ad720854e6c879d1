"""`autotune search --help` reads in groups, in the order a user decides: what to tune, then the budget
and limits, then where the outputs go, then scale-out; the most used option first in each."""

from __future__ import annotations

import re

import pytest

from autotune.cli import build_parser

GROUPS = ["what to tune", "budget and limits", "output and storage", "scale-out (several GPUs or processes)"]


def _search_help(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["search", "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _sections(text: str) -> dict[str, list[str]]:
    """Each heading of the help ("what to tune:") and the options listed under it, in order."""
    sections: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line) and not line.startswith("usage"):
            heading = line[:-1]
            sections[heading] = []
        elif heading and (option := re.match(r"^  (-[-\w]+)", line)):
            sections[heading].append(option.group(1))
    return sections


def test_search_help_groups_its_options_in_the_order_a_user_decides(capsys):
    sections = _sections(_search_help(capsys))
    assert [name for name in sections if name != "options"] == GROUPS
    assert sections["options"] == ["-h"]  # every other option sits in a group
    firsts = [sections[name][0] for name in GROUPS]
    assert firsts == ["--model", "--budget", "--out", "--gpus"]
    assert sum(len(options) for options in sections.values()) == 43  # none lost: 42 options and --help


def test_grouping_keeps_each_options_name_and_default(capsys):
    args = build_parser().parse_args(["search", "--model", "resnet50"])
    assert (args.device, args.budget, args.trials, args.num_classes, args.seed) == ("auto", None, None, 1000, 0)
    assert (args.early_stop_below, args.trial_timeout, args.accuracy_method) == (0.5, 600.0, "parity")
    assert (args.max_accuracy_drop, args.max_loss_drift, args.compile, args.steer, args.profile) == (0.5, 0.1, None, True, True)
    # the accuracy command shares the model and accuracy options, and keeps them
    args = build_parser().parse_args(["accuracy", "--model", "resnet50", "--data", "imgs", "--seq-len", "64"])
    assert (args.data, args.seq_len, args.max_accuracy_drop) == ("imgs", 64, 0.5)
