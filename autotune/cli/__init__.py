"""Command line: autotune search | verify | report | compare | show | models (the options: autotune.cli.options)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from autotune import stop
from autotune.errors import AutotuneError
from autotune.cli.terminal import AccuracyView, SearchView, console, print_cache, print_summary
from autotune.cli.options import add_option as _add_option, add_search as _add_search


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotune", description="Profiling-driven auto-tuner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_search(sub)
    p = sub.add_parser("verify", help="re-measure an exported config through autotune.load, in a fresh worker")
    p.add_argument("config", type=Path, help="config.json or its folder")
    p.add_argument("--repeat", type=int, default=1, help="independent re-measurements (fresh worker each)")
    p.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE,...",
                   help="also measure the config with these Optuna parameters changed (e.g. "
                        "vocab_padding.multiple=1), alternating with it as exported: what a knob buys here")
    p.add_argument("--memory-knobs", action="store_true",
                   help="also measure the config with each memory knob it has on (8-bit optimizer states, fused "
                        "loss, activation checkpointing, expandable segments) turned off in turn, at the same "
                        "batch: what each bought in speed and peak memory (written to memory-knob-pairs.json)")
    p = sub.add_parser("report", help="(re)write report.html, report.md and trials.csv of a search")
    p.add_argument("folder", type=Path, nargs="?", help="the search's output folder (holds study.db)")
    p.add_argument("--storage", help="an Optuna storage URL instead of FOLDER/study.db")
    p.add_argument("--study-name", help="the study in that storage (default: the folder's, or the only one)")
    p.add_argument("--out", type=Path, help="where to write (default: FOLDER, else runs/<study-name>)")
    p = sub.add_parser("compare", help="compare output folders from different GPUs, torch versions or models")
    p.add_argument("folders", type=Path, nargs="+", help="two or more output folders of `autotune search`")
    p.add_argument("--out", type=Path, default=Path("runs/compare"), help="where compare.html/.md go (default runs/compare)")
    p.add_argument("--allow-different-models", action="store_true",
                   help="compare runs of different models (refused by default)")
    p = sub.add_parser("show", help="print an exported configuration")
    p.add_argument("config", type=Path)
    p = sub.add_parser("export", help="write a config's settings for Hugging Face, Lightning or accelerate",
                       description="Translate config.json into a training framework's own settings, written into "
                                   "DIR; what the framework cannot express is printed and written too.")
    p.add_argument("folder", type=Path, help="the search's output folder (holds config.json), or config.json itself")
    p.add_argument("--to", required=True, choices=["hf", "lightning", "accelerate"],
                   help="hf: TrainingArguments kwargs (hf_training_args.json); lightning: Trainer kwargs and "
                        "callback settings (lightning.json); accelerate: accelerate_config.yaml")
    p.add_argument("--out", type=Path, help="where to write (default: the config's folder)")
    sub.add_parser("models", help="list the torchvision model names --model accepts (and hf:TYPE, timm:NAME)")
    p = sub.add_parser("accuracy", help="train each precision mode briefly against FP32 and print the table",
                       description="Each precision mode of the device (fp16 with and without GradScaler) against "
                                   "an FP32 reference: same initial weights, same data, same order.")
    _add_option(p, "--model", "--input-shape", "--num-classes", "--model-config", "--seq-len")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--precisions", help="comma-separated modes (default: all the device runs natively)")
    p.add_argument("--fp32-layers", help="also check autocast modes with these layer kinds kept in FP32, "
                                         "comma-separated combinations such as norm,head,norm+head")
    p.add_argument("--batch-size", type=int, help="the check's batch size (default 64 on GPU, 16 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each training run")
    _add_option(p, "--max-accuracy-drop", "--max-loss-drift", "--accuracy-steps", "--data")
    return parser


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed, for config.json and the report, without a storage's or MLflow's password."""
    from autotune.search.storage import mask_url

    urls = {u for u in (getattr(args, "storage", None), getattr(args, "mlflow", None)) if u}
    argv = [mask_url(a) if a in urls else a for a in sys.argv[1:]]
    return "autotune " + shlex.join(argv)


def _prestart_probe(args: argparse.Namespace) -> None:
    """Start the search's probe worker now, under the GPUs it will see: its imports (torch: seconds)
    then run while this process imports torch for its own checks. A search
    refused by those checks kills it on exit (autotune.trial.runner.discard_spares)."""
    from autotune.errors import ConfigError
    from autotune.trial.gpus import parse_gpus, pinned, probe_view
    from autotune.trial.runner import prestart_setting, start_spare

    try:
        if prestart_setting() is False:
            return
        requested = parse_gpus(args.gpus)
    except ConfigError:  # refused, with its message, by the search's own checks
        return
    device = args.device
    if device == "auto" and sys.platform.startswith("linux") and not os.path.exists("/dev/nvidiactl"):
        device = "cpu"  # no NVIDIA driver here: the search will run on the CPU, its workers forked
    with pinned(probe_view(requested, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        start_spare({"workload": {"model": args.model}, "device": device})


def _workload_spec(args: argparse.Namespace):
    """The workload --model and its options name (search and accuracy alike)."""
    from autotune.workload.hub import parse_model_config
    from autotune.workload.models import WorkloadSpec, parse_input_shape

    return WorkloadSpec(model=args.model, num_classes=args.num_classes,
                        input_shape=parse_input_shape(args.input_shape) if args.input_shape else None,
                        model_config=parse_model_config(args.model_config) if args.model_config else {},
                        seq_len=args.seq_len)


def cmd_search(args: argparse.Namespace) -> int:
    _prestart_probe(args)
    from autotune.errors import ConfigError
    from autotune.search.options import SearchConfig, parse_duration
    from autotune.cli.run import run_search
    from autotune.trial.measure import MeasureSettings

    spec = _workload_spec(args)
    measure = None
    if args.min_measure_time is not None:  # replace() validates it: a typo like 0 or -1 gets a clear error
        import dataclasses

        from autotune.search.options import resolve_device

        try:
            measure = dataclasses.replace(MeasureSettings.for_device(resolve_device(args.device)),
                                          min_time_s=args.min_measure_time)
        except ValueError as exc:
            raise ConfigError(f"--min-measure-time {args.min_measure_time:g}: {exc}") from None
    config = SearchConfig(
        workload=spec, device=args.device, out_dir=args.out, storage=args.storage, study_name=args.study_name,
        trials=args.trials, budget_s=parse_duration(args.budget) if args.budget else None,
        batch_size=args.batch_size, base_batch_size=args.base_batch_size, min_batch_size=args.min_batch_size,
        max_batch_size=args.max_batch_size,
        precisions=[m.strip() for m in args.precisions.split(",")] if args.precisions else None,
        input_on_device=args.input_on_device, compile=args.compile, profile=args.profile, steer=args.steer,
        early_stop_below=args.early_stop_below, started_at=getattr(args, "started_at", None),
        objective=args.objective, measure=measure,
        seed=args.seed, gpus=args.gpus, ddp=args.ddp, replay=args.replay, resume=args.resume,
        memory_limit=args.memory_limit, memory_headroom=args.memory_headroom,
        global_batch_size=args.global_batch_size,
        trial_timeout_s=args.trial_timeout, command=_command_line(args),
        accuracy_check=not args.no_accuracy_check, max_accuracy_drop=args.max_accuracy_drop,
        max_loss_drift=args.max_loss_drift, accuracy_steps=args.accuracy_steps, data=args.data,
        accuracy_share=args.accuracy_share, accuracy_method=args.accuracy_method,
        mlflow=args.mlflow, fresh=args.fresh, cache_limit=args.cache_limit,
    )
    view = SearchView(config)
    try:
        result = run_search(config, on_event=view)
    finally:
        if view.task is not None:
            view.progress.stop()
    ok = print_summary(result.out_dir, result.elapsed_s, result.phases, study=result.study,
                       min_batch_size=result.space.batch_sizes[0], files=result.files)
    print_cache(result.cache)
    return 0 if ok else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from autotune.deploy.config import load
    from autotune.search.verify import verify
    from autotune.workload.hub import parse_assignments
    from autotune.workload.units import Units

    units = Units.from_dict(load(args.config).info.get("units"))

    def rate(samples_per_s: float) -> str:  # a language model's tokens/s beside its samples/s
        tokens = f" ({units.tokens_per_s(samples_per_s):,.0f} tokens/s)" if units.has_tokens else ""
        return f"{samples_per_s:,.0f} samples/s{tokens}"

    changes = parse_assignments(",".join(args.set), option="--set", example="vocab_padding.multiple=1")
    status, out = verify(args.config, repeat=args.repeat, sets=changes, memory_knobs=args.memory_knobs,
                         say=lambda line: console.print(escape(line)), rate=rate)
    if status == 0:
        print(json.dumps(out))
    return status


def cmd_report(args: argparse.Namespace) -> int:
    import optuna

    from autotune.errors import ConfigError
    from autotune.report.export import trials_frame
    from autotune.report.render import write_report

    if args.folder is None and args.storage is None:
        raise ConfigError("give the search's output folder, or --storage URL (and --study-name)")
    config = None
    if args.folder is not None and (args.folder / "config.json").exists():
        config = json.loads((args.folder / "config.json").read_text())
    storage = args.storage
    if storage is None:
        if not (args.folder / "study.db").exists():
            raise ConfigError(f"{args.folder} holds no study.db; pass the folder `autotune search` wrote, "
                              "or --storage URL --study-name NAME")
        storage = f"sqlite:///{args.folder / 'study.db'}"
    name = args.study_name or (config or {}).get("study", {}).get("study_name")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    from autotune.search.storage import open_storage

    storage = open_storage(storage)  # a clear error, password masked, for a URL that does not open
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"cannot load study {name!r} from the storage ({exc}); "
                          "`optuna studies --storage URL` lists the names") from None
    from autotune.search.options import DEFAULT_OUT

    out = args.out or args.folder or DEFAULT_OUT / study.study_name
    out.mkdir(parents=True, exist_ok=True)
    trials_frame(study).to_csv(out / "trials.csv", index=False)
    files = write_report(study, out, config)
    for path in [out / "trials.csv", *files.values()]:
        console.print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from autotune.report.compare import compare

    result = compare(args.folders, args.out, allow_different_models=args.allow_different_models)
    console.print(result.table)
    console.print(f"wrote {result.html} and {result.markdown}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autotune.deploy.config import load

    cfg = load(args.config)
    console.print(cfg.describe())
    return 0 if print_summary(args.config if args.config.is_dir() else args.config.parent) else 1


def cmd_export(args: argparse.Namespace) -> int:
    from autotune.deploy.config import TunedConfig

    cfg = TunedConfig.load(args.folder, here=False)  # a GPU's configuration translates on any machine
    out = args.out or (args.folder if args.folder.is_dir() else args.folder.parent)
    files, unsupported = cfg.export(args.to, out)
    for path in files:
        console.print(f"wrote {path}", soft_wrap=True)  # whole paths, to copy
    if not unsupported:
        console.print(f"every tuned setting is expressed for {args.to}")
    from rich.markup import escape

    for entry in unsupported:  # the why holds code with brackets: not rich markup
        console.print(f"[yellow]not expressible[/] {escape(str(entry['setting']))} = {escape(str(entry['value']))}: "
                      f"{escape(entry['why'])}", highlight=False, soft_wrap=True)
    print(json.dumps({"target": args.to, "files": [str(f) for f in files], "unsupported": unsupported}, default=str))
    return 0


def cmd_accuracy(args: argparse.Namespace) -> int:
    from autotune.accuracy.settings import AccuracySettings
    from autotune.accuracy.study.compare import compare_modes, mode_configurations
    from autotune.space import SearchSpace
    from autotune.errors import ConfigError
    from autotune.search.options import SearchConfig, resolve_device
    from autotune.search.space import probe
    from autotune.workload.models import check_spec
    from strategies.fp32_layers import parse

    spec = _workload_spec(args)
    check_spec(spec)
    device = resolve_device(args.device)
    overrides = {"steps": args.accuracy_steps, "batch_size": args.batch_size, "seed": args.seed, "data": args.data,
                 "max_accuracy_drop": args.max_accuracy_drop, "max_loss_drift": args.max_loss_drift}
    settings = AccuracySettings.for_device(device, **overrides)
    from autotune.workload.data import check_data_spec

    check_data_spec(settings.data)
    layers = [x.strip() for x in args.fp32_layers.split(",")] if args.fp32_layers else []
    for combo in layers:
        try:
            parse(combo)
        except ValueError as exc:
            raise ConfigError(f"--fp32-layers: {exc}") from None
    info = probe(SearchConfig(workload=spec, device=device, accuracy_check=False), device)
    precisions = info["precisions"]
    if args.precisions:
        wanted = [m.strip() for m in args.precisions.split(",")]
        from strategies.precision import MODES

        unknown = [m for m in wanted if m not in MODES]
        if unknown:
            raise ConfigError(f"--precisions: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
        precisions = ["fp32"] + [m for m in wanted if m != "fp32"]
    space = SearchSpace(device=device, precisions=precisions)
    where = info["provenance"].get("gpu", "CPU")
    console.print(f"[bold]accuracy[/] of {spec.model} on {where}: {settings.steps} steps at batch "
                  f"{settings.batch_size} per configuration, against FP32")
    view = AccuracyView(spec.model, where)
    rows = compare_modes(workload=spec.to_dict(), space=space, settings=settings,
                         configurations=mode_configurations(precisions, layers), timeout_s=args.timeout, on_row=view)
    view.print_table()
    print(json.dumps({"model": spec.model, "device": where, "settings": settings.to_dict(), "rows": rows}, default=str))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autotune.workload.models import torchvision_models

    for name in torchvision_models():
        print(name)
    print("... or hf:TYPE, a Hugging Face transformers causal LM built offline from its type's default "
          "configuration (hf:gpt2, hf:llama; --model-config n_layer=2,n_embd=64 and --seq-len N; needs "
          "pip install 'autotune[hf]'), timm:NAME, a timm classifier (timm:resnet18; timm.list_models() "
          "lists them; needs pip install 'autotune[timm]'), or package.module:factory for your own model "
          "(a callable returning an nn.Module or autotune.Workload)", file=sys.stderr)
    return 0


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Our warnings as one line a user reads ("warning: ..."), not Python's file:line form; others
    (a library's deprecation, say) keep theirs."""
    if issubclass(category, UserWarning) and f"{os.sep}autotune{os.sep}" in filename:
        from rich.markup import escape

        console.print(f"[yellow]warning:[/] {escape(str(message))}", highlight=False)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


INTERRUPTED = {
    "search": "finished trials are kept in the study and the outputs were written; run the same command to resume",
    "accuracy": "the configurations checked so far are printed above (the rest were not checked); run it "
                "again with --precisions naming the rest",
}
"""What an interrupted command kept, by command: only a search resumes."""


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # --budget is a promise for the whole command, counted from here
    args = build_parser().parse_args(argv)
    args.started_at = started
    stop.install()
    warnings.showwarning = _show_warning
    handler = {"search": cmd_search, "verify": cmd_verify, "report": cmd_report, "compare": cmd_compare,
               "show": cmd_show, "models": cmd_models, "accuracy": cmd_accuracy,
               "export": cmd_export}[args.command]
    try:
        code = handler(args)
        stop.check()  # a stop request swallowed at the very end still ends as one
        return code
    except AutotuneError as exc:
        from rich.markup import escape

        # escaped: "pip install 'autotune[hf]'" would lose its extra as rich markup
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    except KeyboardInterrupt:
        console.print(f"interrupted: {INTERRUPTED.get(args.command, 'nothing was written')}")
        return 130


if __name__ == "__main__":
    sys.exit(main())
