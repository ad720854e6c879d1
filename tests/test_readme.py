"""The README is a guide a newcomer follows: its first commands are CI's, its training loop trains as
written, its knob list and options are the code's, and its links lead somewhere."""

from __future__ import annotations

import re
import shlex

import pytest

import strategies
from autotune.cli import build_parser
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from conftest import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _section(title: str) -> str:
    """The README's text under ``## title``, up to the next section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"the README has no section {title!r}; update this test"
    return match.group(1)


def _pip_install(command: str) -> list[str]:
    """A `python3 -m pip install ...` line's arguments, without the flags that only quiet it."""
    words = shlex.split(command.split("#")[0])
    assert words[:4] == ["python3", "-m", "pip", "install"], command
    return [w for w in words[4:] if w not in ("-q", "--disable-pip-version-check")]


def test_install_then_main_job_then_tests_as_ci_runs_them():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    install, main_job, tests = [line for line in first_block.splitlines() if line.strip()][:3]
    ci_install = next(line for line in CI.splitlines() if line.startswith("python3 -m pip install"))
    assert _pip_install(install) == _pip_install(ci_install)  # the same packages, pins and extras
    assert main_job.startswith("autotune search --model resnet50 ")
    ci_tests = [line for line in CI.splitlines() if "pytest" in line and not line.startswith("#")]
    assert tests.split("#")[0].strip() == ci_tests[-1].strip() == "python3 -m pytest -q"


def test_the_timing_figures_are_the_measured_ones():
    assert 'python3 -m pytest -q -m "not slow"' in README and "2:40" in README  # the quick tier
    assert "39:02" in README  # a fresh clone's `bash .ci/run`
    assert "under a minute" not in README and "about 20" not in README


def test_the_knob_list_is_the_registry_in_order():
    listed = re.findall(r"^- `([a-z0-9_]+)`:", _section("The knobs"), re.M)
    assert listed == [s.name for s in strategies.REGISTRY]


def test_the_options_table_names_real_options():
    parser = build_parser()._subparsers._group_actions[0].choices["search"]
    known = {flag for action in parser._actions for flag in action.option_strings}
    rows = [line for line in _section("Options").splitlines() if line.startswith("| `")]
    named = {flag for row in rows for flag in re.findall(r"--[a-z][a-z0-9-]*", row.split(" | ")[0])}
    assert named and named <= known, named - known


def test_relative_links_lead_to_files():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"


def test_the_readme_is_a_guide_not_a_log():
    lines = README.splitlines()
    assert len(lines) <= 300
    assert not [n for n, line in enumerate(lines, 1) if len(line) > 160]
    assert not re.search(r"\b[0-9a-f]{7}\b(?<![0-9]{7})", README)  # no commit hashes


def _snippet(**substitutions: str) -> str:
    """The README's training loop, with ``substitutions`` (old text -> new) applied; each old text must
    be there, so that a change to the loop shows up here."""
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    for old, new in substitutions.items():
        assert old in code, f"the README's loop changed: {old!r} is gone; update this test"
        code = code.replace(old, new)
    return code


def _epoch_losses(code: str, capsys) -> list[float]:
    capsys.readouterr()
    exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    return [float(v) for v in re.findall(r"epoch \d+: loss ([0-9.]+)", capsys.readouterr().out)]


SHRINK = {
    "(3, 224, 224)": "(3, 32, 32)",
    "num_workers=4": "num_workers=0",  # the test's process, not a pool of loader workers
}
"""What every test of the loop shrinks: the images, and the loader's workers."""


@pytest.mark.slow
def test_training_loop_runs_with_an_exported_config(tmp_path, capsys):
    """The loop runs under a bf16 channels_last configuration (a ResNet-18 at 32x32, two steps an epoch);
    that it trains is the slow test's below."""
    space = SearchSpace(device="cpu", precisions=["fp32", "bf16"], batch_sizes=[4, 8], base_batch_size=4,
                        memory_formats=["contiguous", "channels_last"], thread_counts=[1, 2])
    cfg = TunedConfig.from_params({"precision.mode": "bf16", "batch_size.batch_size": 8,
                                   "memory_format.format": "channels_last", "threads.num_threads": 2}, space)
    path = tmp_path / "config.json"
    cfg.save(path)
    code = _snippet(**{"runs/resnet50-cpu/config.json": str(path), "resnet50(num_classes=1000)": "resnet18(num_classes=10)",
                       "8 * cfg.batch_size": "2 * cfg.batch_size", **SHRINK})  # 2 steps an epoch: the quick tier's
    losses = _epoch_losses(code, capsys)
    assert len(losses) == 3 and all(v == v for v in losses)  # three epochs, finite


MODELS = {
    # the search's own model: a few conv layers, seconds on 2 cores
    "tiny_cnn": "__import__('fake_models').tiny_cnn(10)",
}
"""What the slow test trains in place of the README's ResNet-50, which takes minutes an epoch on a
2-core CPU: the loop's optimizer, learning rate, data and config calls are the README's, as written."""


@pytest.fixture(scope="module")
def cpu_config(tiny_cpu_search):
    """The config.json of a tiny CPU search, as the main job writes one (the session's shared search)."""
    out, _ = tiny_cpu_search
    return out / "config.json"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_the_readme_loop_trains_with_a_searched_config(cpu_config, model, capsys):
    """The README's loop, run as written against a config a CPU search wrote (only the model, the image
    size and the loader's workers substituted, see MODELS): its last epoch's loss is below its first's.
    The loop used to diverge (SGD at lr 0.1 on random labels: loss 25.6, then 76.2)."""
    code = _snippet(**{"runs/resnet50-cpu/config.json": str(cpu_config),
                       "torchvision.models.resnet50(num_classes=1000)": MODELS[model], **SHRINK})
    losses = _epoch_losses(code, capsys)
    assert len(losses) == 3 and all(v == v for v in losses), losses
    assert losses[-1] < losses[0], f"the README's loop did not train: epoch losses {losses}"
