"""The code keeps the shape its layout promises (scripts/structure.py measures it from the source)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("structure", ROOT / "scripts" / "structure.py")
structure = importlib.util.module_from_spec(_spec)
sys.modules["structure"] = structure  # its dataclasses look their module up
_spec.loader.exec_module(structure)

# which packages a package's modules may not import: the layers run downward only
FORBIDDEN = {
    # one measurement's code never reaches the check worker's (the process entry, autotune.worker, serves both)
    "autotune.trial": ("autotune.accuracy", "autotune.worker", "autotune.search", "autotune.report", "autotune.cli"),
    # what a check worker runs (the parity run, the held-out check's training) never reaches into what
    # the study decides (the gates, the plan, the kept references), nor starts workers of its own
    # nor into the trial worker that serves it (which caps its memory as for a trial)
    "autotune.accuracy.worker": ("autotune.accuracy.study", "autotune.trial", "autotune.search",
                                 "autotune.report", "autotune.cli"),
    # what both sides use sits below both
    "autotune.accuracy.settings": ("autotune.accuracy.worker", "autotune.accuracy.study"),
    "autotune.deploy": ("autotune.search", "autotune.report", "autotune.trial", "autotune.accuracy", "autotune.cli"),
    "autotune.workload": ("autotune.search", "autotune.report", "autotune.trial", "autotune.accuracy",
                          "autotune.deploy", "autotune.cli"),
    "strategies": ("autotune.search", "autotune.report", "autotune.trial", "autotune.accuracy", "autotune.deploy",
                   "autotune.workload", "autotune.cli"),
    # the recipe and the search space are what every knob writes into: they import none of the rooms above them
    "autotune.recipe": ("strategies", "autotune.deploy", "autotune.search", "autotune.trial", "autotune.cli"),
    "autotune.space": ("strategies", "autotune.deploy", "autotune.search", "autotune.trial", "autotune.cli"),
    # the pipeline runs one way: search -> report -> run (run_search, which writes the report) -> cli
    "autotune.search": ("autotune.report", "autotune.cli.run", "autotune.cli"),
    "autotune.report": ("autotune.cli.run", "autotune.cli"),
}


@pytest.fixture(scope="module")
def shape():
    return structure.shape()


def test_no_import_cycles_and_no_upward_imports(shape):
    assert shape["cycles"] == []
    assert shape["upward imports"] == []


def test_no_folder_imports_a_folder_on_its_floor_or_above(shape):
    """A level up: a folder of the package (search/, report/, strategies/, ...) imports only folders below it."""
    assert shape["folders: arrows back up"] == []


def test_the_pipeline_stands_on_at_most_eight_floors(shape):
    """Foundations, the knobs, what user code imports, one measurement and a check's run, the worker process
    and the verdict, the search, the report, the command (docs/layout.md draws them)."""
    assert shape["folders: floors"] <= 8, shape["folders: floor of"]


def test_no_private_name_is_imported_across_modules(shape):
    assert shape["private names imported across modules"] == []


def test_functions_and_modules_stay_small(shape):
    assert shape[f"functions over {structure.MAX_FUNCTION_LINES} lines"] == []
    assert shape[f"modules over {structure.MAX_MODULE_LINES} lines"] == []


def test_each_layer_imports_only_the_layers_below_it():
    modules = structure.read()
    broken = [f"{name} imports {target}"
              for name, module in modules.items()
              for layer, forbidden in FORBIDDEN.items() if name == layer or name.startswith(layer + ".")
              for target in sorted(module.top | module.lazy) if target.startswith(forbidden)]
    assert broken == []


def test_the_measure_sees_a_cycle_a_lazy_upward_import_and_a_long_function(tmp_path):
    """The script itself: a planted package with each defect is reported as such."""
    pkg = tmp_path / "autotune"
    pkg.mkdir()
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text(textwrap.dedent("""
        def later():
            from autotune.high import _helper  # lazy, upward, private
            return _helper
    """))
    body = "\n".join(f"    x{i} = {i}" for i in range(structure.MAX_FUNCTION_LINES + 1))
    (pkg / "high.py").write_text(f"from autotune.low import later\n\n\ndef _helper():\n{body}\n")
    found = structure.shape(tmp_path)
    assert found["cycles"] == [["autotune.high", "autotune.low"]]
    assert found["upward imports"]  # the arrow that closes the cycle points up
    assert found["private names imported across modules"] == ["autotune.low: _helper from autotune.high"]
    assert [name for name, _ in found[f"functions over {structure.MAX_FUNCTION_LINES} lines"]] == ["autotune.high._helper"]


def test_the_measure_sees_two_folders_that_import_each_other(tmp_path):
    """A level up: folders are rooms, and an import between two folders that closes a cycle runs back up."""
    for folder in ("autotune", "autotune/low", "autotune/high", "strategies"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "autotune" / "errors.py").write_text("")
    (tmp_path / "autotune" / "low" / "base.py").write_text("from autotune.errors import *\n")
    (tmp_path / "autotune" / "high" / "top.py").write_text("from autotune.low.base import *\n")
    found = structure.shape(tmp_path)
    assert found["folders: arrows back up"] == []
    assert found["folders: floor of"]["autotune.errors"] < found["folders: floor of"]["autotune.low"] \
        < found["folders: floor of"]["autotune.high"]
    (tmp_path / "autotune" / "low" / "util.py").write_text("def f():\n    from autotune.high import top\n")
    found = structure.shape(tmp_path)
    assert "autotune.low -> autotune.high (autotune.low.util imports autotune.high.top)" \
        in found["folders: arrows back up"]


def test_one_module_queues_prunes_skips_and_stops_and_only_crash_recovery_reaches_into_optuna():
    """What runs next, and what ends unmeasured, is decided in autotune/search/queue.py: no other module
    of the package queues a trial with Optuna, prunes, skips or stops the search; and no module but the
    storage's crash recovery touches Optuna's private attributes."""
    import re

    calls = {
        "queues a trial": re.compile(r"\.enqueue_trial\(|\.ask\("),
        "prunes": re.compile(r"raise\s+(optuna\.)?TrialPruned"),
        "skips": re.compile(r"raise\s+TrialFailed\(f?\"trial \{trial\.number\} not run"),
        "stops": re.compile(r"\bstudy\.stop\(\)"),
        "touches Optuna's private attributes": re.compile(
            r"(study|storage|trial|frozen|t)\._(storage|study_id|trial_id|get_stale_trial_ids|pop_waiting_trial_id|"
            r"stop_flag|retrying)\b"),
    }
    allowed = {"queues a trial": {"autotune/search/queue.py", "autotune/search/storage.py"},
               "touches Optuna's private attributes": {"autotune/search/storage.py"}}
    found = []
    for path in sorted((ROOT / "autotune").rglob("*.py")) + sorted((ROOT / "strategies").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        for what, pattern in calls.items():
            if pattern.search(code) and name not in allowed.get(what, {"autotune/search/queue.py"}):
                found.append(f"{name} {what}")
    assert found == []


PROPOSERS = ("seeds", "plain_recipe", "neighbours", "steering", "screening", "warm", "distributed", "fit",
             "findings")
"""The modules of autotune/search/ that propose candidates (and autotune/search/objective.py's back-off)."""


def test_proposers_return_candidates_and_only_the_queue_writes_it():
    """A proposer reads the study and returns candidates (autotune.search.queue.Candidate); only
    autotune/search/queue.py puts them in the queue (``put``, and ``prune``, ``skip`` and ``requeue`` with
    theirs), so no proposer module imports or calls the queue's writers nor names the queue's attributes."""
    import ast

    writers = {"propose", "put", "requeue", "enqueue_trial"}
    attrs = {"CANDIDATES_ATTR", "_NEXT_ATTR", "autotune:candidates", "autotune:next_candidate"}

    def writes(tree: ast.AST) -> list[str]:
        found = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"imports {a.name}" for a in node.names if a.name.rpartition(".")[2] in writers | attrs]
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                found += [f"calls {name}"] if name in writers else []
            elif isinstance(node, (ast.Name, ast.Attribute, ast.Constant)):
                name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "value", None)
                found += [f"names {name}"] if isinstance(name, str) and name in attrs else []
        return found

    trees = {f"autotune/search/{name}.py": ast.parse((ROOT / "autotune" / "search" / f"{name}.py").read_text())
             for name in PROPOSERS}
    objective = ast.parse((ROOT / "autotune" / "search" / "objective.py").read_text())
    trees["autotune/search/objective.py: Objective._back_off"] = next(
        node for node in ast.walk(objective) if isinstance(node, ast.FunctionDef) and node.name == "_back_off")
    assert [f"{name} {what}" for name, tree in trees.items() for what in writes(tree)] == []


def test_the_objective_is_built_whole_and_the_search_config_never_changes():
    """Configuration flows one way: the command's options are a frozen SearchConfig, and the objective is
    built with everything it uses (the stop rule's walls, the planner, the live line), never given an
    attribute after it is built. Read from the code's syntax tree."""
    import ast

    from autotune.search.options import SearchConfig

    assert SearchConfig.__dataclass_params__.frozen
    assigned = []
    for path in sorted((ROOT / "autotune").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in (
                            "objective", "config"):
                        assigned.append(f"{path.relative_to(ROOT)}:{node.lineno} {t.value.id}.{t.attr}")
    assert assigned == []  # before: run_search gave the objective on_phase, walls, compile_prior_s and planner
