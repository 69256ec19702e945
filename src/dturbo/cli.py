"""The ``dturbo`` command: run experiments, draw their figures."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .checkpoint import CheckpointError
from .config import ConfigError
from .rundir import RunDir, RunDirLocked
from .settings import load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="D-Turbo-VBI: Bayesian federated model compression.")
config_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Show configurations.")
app.add_typer(config_app, name="config")
console = Console(stderr=True, soft_wrap=True)  # a line of a log or a pipe is one line, never cut at 80 columns


def _version(value: bool) -> None:
    if value:
        from ._version import __version__

        print(f"dturbo {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """D-Turbo-VBI: Bayesian federated model compression."""


def _load(config: Path | None, preset: str | None, overrides: list[str] | None) -> Any:
    """The config of a command: a TOML file or a preset (one of the two), with --set overrides."""
    if (config is None) == (preset is None):
        _fail("give a CONFIG file or --preset NAME (one of the two); `dturbo presets` lists the presets")
    try:
        return load_config(config, overrides or [], preset=preset)
    except ConfigError as err:
        _fail(str(err))


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}")
    raise typer.Exit(2)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    console.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False)


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(help="experiment config (TOML); or give --preset")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory (new, or empty)")] = None,
    preset: Annotated[str | None, typer.Option(help="a preset shipped with dturbo (`dturbo presets`)")] = None,
    resume: Annotated[bool, typer.Option(help="continue from the run directory's checkpoint")] = False,
    resume_unverified: Annotated[bool, typer.Option(help=(
        "--resume from a checkpoint without a checksum of the whole file (an older dturbo's), which --resume "
        "refuses: only one you wrote and trust"))] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a config key: section.key=value")] = None,
    figures: Annotated[bool, typer.Option(help="draw the run's figures at the end")] = True,
) -> None:
    """Run a federated experiment (in one process) into OUT, from a CONFIG file or a --preset."""
    from .data import DataError
    from .sim import (
        PoisonedStateError,
        ProgressLine,
        TooFewClientsError,
        format_bits,
        round_summary,
        start_run,
    )

    cfg = _load(config, preset, set_)
    if out is None:
        _fail("--out DIR: the run directory to write (a new or empty one)")
        return
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} names a file; --out must be a directory (a new or empty one for a new run)")
    resume = resume or resume_unverified
    if resume and not RunDir(out).config_path.exists():
        _fail(f"--resume: {out} holds no run (no config.toml)")
    done = [0]  # the last round recorded (checkpointed)
    try:
        t0 = time.perf_counter()
        tty = console.is_terminal
        progress = Progress(
            TextColumn("round {task.completed:.0f}/{task.total:.0f}"), BarColumn(), TaskProgressColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
            console=console, disable=not tty,
        )

        line = ProgressLine(cfg.experiment.rounds)

        def on_round(row: dict[str, Any]) -> None:
            progress.update(task, completed=int(row["round"]), info=round_summary(row))
            done[0] = int(row["round"])
            if not tty:  # logs: one line per round, with the time left at the mean pace so far
                console.print(line(row), highlight=False)

        # Warnings (a schedule that ends after the run, labels with gaps, an unverifiable checkpoint) go to the
        # console as they happen, not as Python's file:line lines.
        with progress, warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            sim = start_run(cfg, out, lambda line: console.print(line, highlight=False),
                            resume="unverified" if resume_unverified else resume, on_round=on_round)
            task = progress.add_task("rounds", total=cfg.experiment.rounds, info="", completed=0)
            rows = sim.run()
    except KeyboardInterrupt:
        kept = (f"the checkpoint of round {done[0]} is intact: continue with `dturbo run ... --out {out} --resume`"
                if done[0] else "no round was saved yet")
        console.print(f"[bold yellow]interrupted:[/] {escape(kept)}")
        raise typer.Exit(130) from None
    except (ConfigError, DataError, CheckpointError, FileExistsError, ValueError, TooFewClientsError,
            PoisonedStateError, RunDirLocked) as err:
        _fail(str(err))
        return
    except OSError as err:  # the run directory cannot be written (--out /proc/self, a read-only disk)
        _fail(f"cannot write the run directory {out}: {err.strerror or err}")
        return
    if rows:
        last = rows[-1]
        console.print(f"done in {time.perf_counter() - t0:.0f} s: accuracy {float(last['accuracy']):.4f}, "
                      f"density {float(last['density']):.4f}, total bits {format_bits(float(last['cum_bits']))}")
    if figures:
        from .report import draw_run

        for path in draw_run(out):
            console.print(f"figure: {path}")


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="run directories")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="where figures go (default: RUN/figures)")] = None,
    target: Annotated[list[float] | None, typer.Option(
        help="accuracy (0-1) for the 'bits to reach' columns; repeatable (default: the lowest final accuracy among "
             "the runs that learned)")] = None,
    inference: Annotated[bool, typer.Option(help=(
        "add a column: one timed forward pass of 3000 test samples per run (a rough single timing; "
        "benchmarks/speed.py measures an exported model's speedup)"))] = False,
) -> None:
    """Draw the figures of one run, or compare several: accuracy vs bits, table (Markdown + CSV), heat maps."""
    from .report import compare, draw_run

    for run_dir in runs:
        if not RunDir(run_dir).metrics_path.exists():
            _fail(f"{run_dir} holds no run (no metrics.csv)")
        if not RunDir(run_dir).config_path.exists():
            _fail(f"{run_dir} holds no config.toml")
    for t in target or []:
        if not 0 < t <= 1:
            _fail(f"--target {t}: an accuracy between 0 and 1")
    if len(runs) == 1 and out is None:
        for path in draw_run(runs[0]):
            console.print(f"figure: {path}")
        return
    try:
        summaries, files = compare(runs, out or Path("report"), targets=target or None, inference=inference)
    except (ConfigError, ValueError) as err:
        _fail(str(err))
        return
    for path in files:
        console.print(f"wrote {path}")
    console.print(Path(out or "report", "comparison.md").read_text(), soft_wrap=True)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="run directory (config.toml + model.safetensors)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for the exported model")],
    compaction: Annotated[bool, typer.Option(help="remove all-zero rows, columns and channels")] = True,
) -> None:
    """Export a run's global model as a compact inference model (safetensors + JSON, no pickle); load it with
    dturbo.export.load(OUT)."""
    from .export import ExportError, export_run

    try:
        exported = export_run(run_dir, out, compaction=compaction)
    except ExportError as err:
        _fail(str(err))
        return
    for r in exported.layers:
        console.print(f"{r['name']:>8}: {'x'.join(map(str, r['shape_before']))} -> "
                      f"{'x'.join(map(str, r['shape_after']))}  density {r['density_before']:.3f} -> "
                      f"{r['density_after']:.3f}")
    from .export import removed_nothing

    totals = exported.spec()["totals"]
    console.print(f"wrote {out}: {totals['weights_after']} of {totals['weights_before']} weights kept, "
                  f"{totals['nonzeros']} nonzero")
    if (note := removed_nothing(exported.spec())) is not None:
        console.print(f"[bold yellow]note:[/] {escape(note)}", highlight=False)
    norm = exported.input_norm
    if norm is not None:
        raw = "pixel values 0..255" if norm["scale"] == 255 else "values as the data files hold them"
        console.print(f"inputs: dturbo.export.load({escape(str(out))!r}) takes inputs normalised as dturbo's "
                      f"readers do; load(..., inputs='raw') takes raw data ({raw}) and normalises it itself")
    else:
        console.print("[bold yellow]warning:[/] the run's input normalisation is unknown (it predates stored "
                      "normalisation and its data could not be read): the exported model takes normalised inputs "
                      "only", highlight=False)


@app.command()
def presets() -> None:
    """List the presets shipped with dturbo, one line each (run one with `dturbo run --preset NAME --out DIR`)."""
    from . import presets as p

    width = max(len(n) for n in p.names())
    for name in p.names():
        print(f"{name:<{width}}  {p.describe(name)}")


@config_app.command("show")
def config_show(
    config: Annotated[Path | None, typer.Argument(help="experiment config (TOML); or give --preset")] = None,
    preset: Annotated[str | None, typer.Option(help="a preset shipped with dturbo (`dturbo presets`)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="override a config key: section.key=value")] = None,
) -> None:
    """Print the whole configuration (every key, defaults filled in) of a CONFIG file or a --preset, as TOML: a
    file to start one's own from."""
    cfg = _load(config, preset, set_)
    print(cfg.to_toml(), end="")


def main() -> None:  # pragma: no cover
    sys.exit(app())
