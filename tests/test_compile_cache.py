"""The config carries its compile (autotune.deploy.compile_cache): a compiled configuration's
compile-cache.zip, saved where it compiled, makes the first compiled step of a fresh process with an
empty Inductor cache load its graphs and kernels instead of compiling them; a foreign or corrupt
archive is refused in one line and the step compiles as without it; a search keeps the
recommendation's archive beside config.json and no other.

The timed tests run each first step in a fresh process (as a user's restart is), from
``cfg.prepare`` (which loads the archive) to the first step's end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import optuna
import pytest
import torch

from autotune.deploy import compile_cache
from autotune.deploy.config import TunedConfig
from autotune.space import SearchSpace
from autotune.search.outputs import compile_archive_name, keep_compile_cache, prune_compile_archives
from conftest import measured, run_cli, subprocess_env

optuna.logging.set_verbosity(optuna.logging.WARNING)

CPU_SPACE = SearchSpace(device="cpu", batch_sizes=[8], base_batch_size=8, compile_modes=["off", "default"])
GPU_SPACE = SearchSpace(device="cuda", batch_sizes=[32], base_batch_size=32, compile_modes=["off", "default"])

# a user's training script: load the config, prepare, the first step timed from prepare (which loads
# the archive) to its end; the Inductor cache's counters say what the step loaded and what it compiled
FIRST_STEP = """
import json, sys, time, warnings
import torch
import autotune
from autotune.deploy import compile_cache

config, model_name, shape, save_to = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    cfg = autotune.load(config)
    torch.manual_seed(0)
    if model_name != "tiny":  # a torchvision model by name
        import torchvision
        model = getattr(torchvision.models, model_name)(num_classes=10)
    else:
        import fake_models
        model = fake_models.tiny_cnn_module(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.batch_size, *map(int, shape.split("x")), generator=g).to(cfg.device)
    y = torch.randint(0, 10, (cfg.batch_size,), generator=g).to(cfg.device)
    if cfg.device == "cuda":
        torch.cuda.synchronize()  # the CUDA context is made before the clock starts: no compile's cost
    started = time.perf_counter()
    model, optimizer = cfg.prepare(model, optimizer)
    prepare_s = time.perf_counter() - started
    step = cfg.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    losses = [float(step(x, y))]
    first_step_s = time.perf_counter() - started
    losses.append(float(step(x, y)))
from torch._dynamo.utils import compile_times, counters
# where the step's time went: Dynamo's timed phases (tracing, the caches' loads, Inductor), slowest first
names, seconds = compile_times(repr="csv", aggregate=True)
phases = dict(sorted(((n, round(float(s), 2)) for n, s in zip(names, seconds)), key=lambda p: -p[1])[:8])
out = {"first_step_s": first_step_s, "prepare_s": prepare_s, "losses": losses, "phases": phases,
       "warnings": [str(w.message) for w in said if "compile-cache" in str(w.message)],
       "fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
       "fx_graph_misses": counters["inductor"]["fxgraph_cache_miss"],
       "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
       "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]}
if save_to:
    out["saved"] = compile_cache.save(save_to[0], cfg.device)
print(json.dumps(out))
"""


def first_step(tmp: Path, folder: Path, inductor_cache: Path, *, model: str = "tiny", shape: str = "3x16x16",
               save: bool = False) -> dict:
    """A fresh process's first compiled step of ``folder``'s config, with TORCHINDUCTOR_CACHE_DIR
    ``inductor_cache``; with ``save``, it then saves its compile beside the config."""
    script = tmp / "first_step.py"
    script.write_text(FIRST_STEP)
    args = [sys.executable, str(script), str(folder / "config.json"), model, shape]
    if save:
        args.append(str(folder / compile_cache.ARCHIVE))
    proc = subprocess.run(args, env=subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(inductor_cache)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record_archive(folder: Path) -> None:
    """config.json records its archive, as a search's export does."""
    data = json.loads((folder / "config.json").read_text())
    data["compile_cache"] = compile_cache.describe(folder / compile_cache.ARCHIVE)
    (folder / "config.json").write_text(json.dumps(data))


def compiled_config(folder: Path, space: SearchSpace = CPU_SPACE) -> Path:
    folder.mkdir(parents=True)
    TunedConfig.from_params({"compile.mode": "default"}, space).save(folder / "config.json")
    return folder


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> dict:
    """A compiled tiny CNN's first step in a fresh process with an empty Inductor cache, its compile
    then saved beside its config.json (as a search's trial saves it)."""
    tmp = tmp_path_factory.mktemp("compile-cache")
    folder = compiled_config(tmp / "run")
    result = first_step(tmp, folder, tmp / "cold-inductor-cache", save=True)
    record_archive(folder)
    return {"tmp": tmp, "folder": folder, "inductor_cache": tmp / "cold-inductor-cache", **result}


@pytest.mark.slow
def test_a_fresh_process_loads_the_compile_instead_of_redoing_it(cold) -> None:
    assert cold["fx_graph_misses"] >= 1 and cold["fx_graph_hits"] == 0 and cold["aot_autograd_misses"] >= 1
    saved = cold["saved"]
    assert saved["device"] == "cpu" and saved["torch"] == torch.__version__ and saved["bytes"] > 0
    assert saved["entries"]["inductor"] >= 1 and saved["entries"]["aot_autograd"] >= 1
    assert saved["libraries"] >= 1  # a CPU's compiled C++ kernels, which the Mega-Cache lacks
    recorded = json.loads((cold["folder"] / "config.json").read_text())["compile_cache"]
    assert recorded["file"] == compile_cache.ARCHIVE and recorded["bytes"] == saved["bytes"]

    tmp = cold["tmp"]
    loaded = first_step(tmp, cold["folder"], tmp / "fresh-inductor-cache")  # empty: nothing but the archive
    assert loaded["warnings"] == []
    assert loaded["fx_graph_hits"] >= 1 and loaded["fx_graph_misses"] == 0
    assert loaded["aot_autograd_hits"] >= 1 and loaded["aot_autograd_misses"] == 0
    assert loaded["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    print(f"\nfirst compiled step: cold {cold['first_step_s']:.1f} s, with {saved['bytes'] / 2**20:.2f} MiB of "
          f"compile cache {loaded['first_step_s']:.1f} s (prepare {loaded['prepare_s']:.1f} s; {loaded['phases']})")
    # the issue's figure is a quarter (scripts/warm_start_bench.py measures it: 15% on a quiet 2-core CPU);
    # a loaded step still traces the model, and in a busy CI run it took 27% (4.1 s against 15.3 s), so
    # the test holds the loaded step to half: a compile that is not loaded takes all of the cold one's
    assert loaded["first_step_s"] <= cold["first_step_s"] / 2


def forge_torch(archive: Path) -> None:
    rewrite(archive, compile_cache.META, lambda meta: json.dumps({**json.loads(meta), "torch": "2.0.0"}).encode())


def corrupt_blob(archive: Path) -> None:
    rewrite(archive, compile_cache.MEGA_CACHE, lambda blob: b"\x00not a mega-cache" * 64)


def rewrite(archive: Path, member: str, change) -> None:
    with zipfile.ZipFile(archive) as old:
        contents = {name: old.read(name) for name in old.namelist()}
    contents[member] = change(contents[member])
    with zipfile.ZipFile(archive, "w") as new:
        for name, data in contents.items():
            new.writestr(name, data)


@pytest.mark.slow
@pytest.mark.parametrize("spoil, reason", [(forge_torch, "it was compiled with torch 2.0.0, this is torch "),
                                           (corrupt_blob, "torch could not read its Mega-Cache")])
def test_a_foreign_or_corrupt_archive_is_refused_in_one_line_and_the_config_still_trains(cold, spoil, reason) -> None:
    folder = cold["tmp"] / spoil.__name__
    shutil.copytree(cold["folder"], folder)
    spoil(folder / compile_cache.ARCHIVE)
    # the cold run's Inductor cache: the step compiles as it would without the archive, in seconds
    result = first_step(cold["tmp"], folder, cold["inductor_cache"])
    (said,) = result["warnings"]
    assert "\n" not in said and reason in said and str(folder / compile_cache.ARCHIVE) in said
    assert said.endswith("the first compiled step compiles from scratch")
    assert result["losses"] == pytest.approx(cold["losses"], rel=1e-5)


# refusals, without a compile --------------------------------------------------------------------


def test_a_refused_archive_puts_nothing_in_the_inductor_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    archive = tmp_path / compile_cache.ARCHIVE
    meta = {"format": compile_cache.FORMAT, **compile_cache.valid_for("cpu")}
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(compile_cache.META, json.dumps({**meta, "torch": "2.0.0"}))
        zf.writestr(compile_cache.MEGA_CACHE, b"")
        zf.writestr(compile_cache.LIBRARIES + "ab/cabc.so", b"\x7fELF")
    assert compile_cache.load(archive, "cpu").startswith("it was compiled with torch 2.0.0")
    assert not any((tmp_path / "inductor").rglob("*"))
    # a library named outside the cache folder is refused before anything is written
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr(compile_cache.META, json.dumps(meta))
        zf.writestr(compile_cache.MEGA_CACHE, b"")
        zf.writestr(compile_cache.LIBRARIES + "../../escaped.so", b"\x7fELF")
    assert compile_cache.load(archive, "cpu") == "it names a library outside Inductor's cache folder"
    assert not (tmp_path / "escaped.so").exists()


def test_each_refusal_says_why(tmp_path) -> None:
    here = {"format": compile_cache.FORMAT, **compile_cache.valid_for("cpu")}
    assert compile_cache.mismatch(here, "cpu") is None
    assert compile_cache.mismatch({**here, "triton": "0.1"}, "cpu") is None  # a CPU compile has no Triton kernel
    assert "compiled for NVIDIA H100 80GB HBM3, this process runs on cpu" in compile_cache.mismatch(
        {**here, "device": "NVIDIA H100 80GB HBM3"}, "cpu")
    assert "format 99" in compile_cache.mismatch({**here, "format": 99}, "cpu")
    assert "compiled for a CPU with AVX512_NOT_HERE" in compile_cache.mismatch(
        {**here, "cpu_capability": "AVX512_NOT_HERE"}, "cpu")
    assert compile_cache.load(tmp_path / "gone.zip", "cpu") == "the file is missing"
    (tmp_path / "cut.zip").write_bytes(b"PK\x03\x04 cut short")
    assert compile_cache.load(tmp_path / "cut.zip", "cpu").startswith("it is not a readable compile-cache archive")
    assert compile_cache.describe(tmp_path / "cut.zip") is None


def test_prepare_warns_once_where_the_archive_config_json_names_is_missing(tmp_path) -> None:
    import fake_models

    folder = compiled_config(tmp_path / "run")
    data = json.loads((folder / "config.json").read_text())
    data["compile_cache"] = {"file": compile_cache.ARCHIVE, "bytes": 1}
    (folder / "config.json").write_text(json.dumps(data))
    cfg = TunedConfig.load(folder)
    assert cfg.compile_cache_path == folder / compile_cache.ARCHIVE
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        model = fake_models.tiny_cnn(10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = cfg.prepare(model, optimizer)  # compiles lazily: no compile here
        cfg.train_step(model, optimizer, torch.nn.functional.cross_entropy)
    (warning,) = [w for w in said if "compile-cache" in str(w.message)]  # once, not per call
    assert str(warning.message) == (f"{folder / compile_cache.ARCHIVE} not loaded: the file is missing; the first "
                                    "compiled step compiles from scratch")
    assert warning.filename == __file__  # it points at the user's line
    # an eager configuration has no compile cache to load, whatever config.json says
    data["params"]["compile.mode"] = "off"
    data["knobs"]["compile"]["mode"] = "off"
    (folder / "config.json").write_text(json.dumps(data))
    assert TunedConfig.load(folder).compile_cache_path is None


def test_the_exports_say_how_a_script_loads_the_compile_cache(tmp_path) -> None:
    pytest.importorskip("yaml")
    folder = compiled_config(tmp_path / "run")
    (folder / compile_cache.ARCHIVE).write_bytes(b"")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "compile_cache": {"file": compile_cache.ARCHIVE}}))
    cfg = TunedConfig.load(folder, here=False)
    call = "import autotune; autotune.load_compile_cache('compile-cache.zip')"
    cfg.export("hf", folder)
    assert json.loads((folder / "hf_training_args.json").read_text())["compile_cache"]["load"].startswith(call)
    cfg.export("accelerate", folder)
    assert (folder / "accelerate_config.yaml").read_text().startswith(f"# compile cache: {call}")
    assert json.loads((folder / "accelerate_kwargs.json").read_text())["compile_cache"]["file"] == "compile-cache.zip"
    cfg.export("hf", tmp_path / "elsewhere")  # the path from the export's folder
    note = json.loads((tmp_path / "elsewhere" / "hf_training_args.json").read_text())["compile_cache"]
    assert note["file"] == "../run/compile-cache.zip"


@pytest.mark.slow
def test_the_lightning_callback_loads_the_compile_cache_before_it_compiles(tmp_path) -> None:
    pytest.importorskip("lightning")
    import fake_models

    folder = compiled_config(tmp_path / "run")
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, "compile_cache": {"file": compile_cache.ARCHIVE}}))
    exp = TunedConfig.load(folder).lightning()
    (callback,) = exp.trainer_kwargs["callbacks"]
    assert callback.compile_cache_path == folder / compile_cache.ARCHIVE
    module = fake_models.tiny_cnn_module(10)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        callback.setup(None, module, "fit")
    assert [str(w.message) for w in said if "compile-cache" in str(w.message)] == [
        f"{folder / compile_cache.ARCHIVE} not loaded: the file is missing; the first compiled step compiles from scratch"]
    assert module._compiled_call_impl is not None  # compiled as without it


# the search's archives --------------------------------------------------------------------------


def _study_with_archives(log_dir: Path, values: list[float]) -> optuna.Study:
    """A study of compiled trials with ``values``, each with its archive in ``log_dir``."""
    study = optuna.create_study(direction="maximize")
    for number, value in enumerate(values):
        name = compile_archive_name(number)
        (log_dir / name).write_bytes(b"archive")
        measured(study, CPU_SPACE, {"compile.mode": "default"}, value,
                 knobs={"compile": {"mode": "default"}}, figures={"compile_archive": {"file": name, "bytes": 7}})
    return study


def test_an_archive_without_graphs_says_its_first_step_still_compiles(monkeypatch) -> None:
    """On an H100 the 1B Llama's recommendation (fp8 on its feed-forward layers, a fused linear
    cross-entropy, recomputed blocks) saved 29 autotuning entries and no graph: the summary said
    "cfg.prepare loads it before the first compiled step" of an archive that saves no compile."""
    from torch._dynamo.utils import counters

    from autotune.cli.terminal import compile_cache_line

    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_bypass", 2)
    monkeypatch.setitem(counters["aot_autograd"], "autograd_cache_bypass", 0)
    assert compile_cache.bypassed() == {"inductor": 2}
    meta = {"file": "compile-cache.zip", "bytes": 3702, "torch": "2.11.0+cu130", "triton": "3.6.0",
            "device": "NVIDIA H100 80GB HBM3", "entries": {"autotune": 29}, "bypassed": {"inductor": 2}}
    line = compile_cache_line({"compile_cache": meta})
    assert "Inductor cached none of this configuration's graphs (2 bypassed its cache)" in line
    assert "still compiles them (the archive carries autotune entries)" in line and "cfg.prepare loads" not in line
    with_graphs = {**meta, "entries": {"autotune": 3, "inductor": 2, "aot_autograd": 1}, "bypassed": {}}
    assert compile_cache_line({"compile_cache": with_graphs}).endswith("cfg.prepare loads it before the first compiled step")


def test_logs_keep_the_archives_of_the_best_few_trials_and_the_running_ones(tmp_path) -> None:
    study = _study_with_archives(tmp_path, [10.0, 30.0, 20.0, 5.0])
    running = study.ask()  # its worker is saving its archive
    (tmp_path / compile_archive_name(running.number)).write_bytes(b"archive")
    prune_compile_archives(study, tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("compile-*.zip")) == [
        compile_archive_name(1), compile_archive_name(2), compile_archive_name(running.number)]


def test_the_best_trials_archive_goes_beside_config_json_and_logs_keep_none(tmp_path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    study = _study_with_archives(logs, [10.0, 30.0, 20.0])
    assert keep_compile_cache(study, tmp_path) == {compile_cache.ARCHIVE: tmp_path / compile_cache.ARCHIVE}
    assert not list(logs.glob("compile-*.zip"))
    # resumed, the same best: its archive stays (logs/ no longer holds it)
    (tmp_path / "config.json").write_text(json.dumps({"study": {"trial_number": 1}}))
    assert keep_compile_cache(study, tmp_path) == {compile_cache.ARCHIVE: tmp_path / compile_cache.ARCHIVE}
    # a faster eager trial: no compile to carry, and the old archive goes
    measured(study, CPU_SPACE, {"compile.mode": "off"}, 50.0, knobs={"compile": {"mode": "off"}}, figures={})
    assert keep_compile_cache(study, tmp_path) == {}
    assert not (tmp_path / compile_cache.ARCHIVE).exists()


@pytest.mark.slow
def test_a_search_keeps_the_compiled_recommendations_compile_beside_config_json(tmp_path) -> None:
    # the search replays a compiled configuration first (as it ran: no eager twin first), then its baseline;
    # the model's eager steps sleep and its compiled ones do not, so the compiled one is recommended
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    optuna.create_study(storage=f"sqlite:///{earlier / 'study.db'}", direction="maximize").add_trial(
        optuna.trial.create_trial(params={"compile.mode": "default"}, value=1.0,
                                  distributions={"compile.mode": optuna.distributions.CategoricalDistribution(
                                      ["off", "default"])}))
    out = tmp_path / "run"
    proc = run_cli("search", "--model", "fake_models:faster_compiled", "--device", "cpu", "--input-shape", "3x32x32",
                   "--num-classes", "10", "--batch-size", "8", "--precisions", "fp32", "--min-measure-time", "0.2",
                   "--no-accuracy-check", "--no-profile", "--compile", "--replay", str(earlier), "--trials", "2",
                   "--out", str(out))
    data = json.loads((out / "config.json").read_text())
    assert data["knobs"]["compile"]["mode"] == "default"
    archive = out / compile_cache.ARCHIVE
    assert data["compile_cache"] == compile_cache.describe(archive)
    assert data["compile_cache"]["bytes"] == archive.stat().st_size and data["compile_cache"]["device"] == "cpu"
    assert not list((out / "logs").glob("compile-*")), "logs/ keeps no compile archive"
    said = " ".join(proc.stderr.split())  # the summary, as the terminal wrapped it
    assert f"compile cache: compile-cache.zip, {archive.stat().st_size / 2**20:.1f} MiB" in said
    assert TunedConfig.load(out).compile_cache_path == archive
    assert compile_cache.mismatch(json.loads(zipfile.ZipFile(archive).read(compile_cache.META)), "cpu") is None


# on a GPU: the Mega-Cache carries Inductor's Triton kernels -------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_a_fresh_process_loads_the_compile_instead_of_redoing_it(tmp_path) -> None:
    """Issue 59's figure, on its model: a ResNet-50's first compiled step in a fresh process takes at most
    15% of its cold compile's time with the compile carried. The phases printed say where a loaded step's
    time goes (an H100 took 4.3 s of a ResNet-18's 17.6 s at 64x64 with both graphs loaded)."""
    folder = compiled_config(tmp_path / "run", GPU_SPACE)
    cold = first_step(tmp_path, folder, tmp_path / "cold-inductor-cache", model="resnet50", shape="3x224x224",
                      save=True)
    assert cold["fx_graph_misses"] >= 1 and cold["fx_graph_hits"] == 0
    saved = cold["saved"]
    assert saved["device"] == torch.cuda.get_device_name() and saved["entries"]["inductor"] >= 1
    record_archive(folder)
    loaded = first_step(tmp_path, folder, tmp_path / "fresh-inductor-cache", model="resnet50", shape="3x224x224")
    print(f"\n{saved['device']}: first compiled step cold {cold['first_step_s']:.1f} s, with "
          f"{saved['bytes'] / 2**20:.1f} MiB of compile cache ({saved['libraries']} libraries) "
          f"{loaded['first_step_s']:.1f} s; {loaded}")
    assert loaded["warnings"] == []
    assert loaded["fx_graph_hits"] >= 1 and loaded["fx_graph_misses"] == 0 and loaded["aot_autograd_misses"] == 0
    assert loaded["first_step_s"] <= 0.15 * cold["first_step_s"]
