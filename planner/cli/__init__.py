"""The ``zeppelin`` command line.

Each command family lives in its own module of this package (``basic``, ``data``, ``plan``, ``sim``,
``run``, ``profile``); heavy dependencies (pulp, networkx, matplotlib,
torch) are imported inside the command functions so that ``zeppelin --help`` stays fast and
planning never imports torch.
"""

from __future__ import annotations

import sys
import time

STARTED_AT = time.time()  # `zeppelin run` counts its ranks' start-up from here (runtime/startup.py)

import typer

from zeppelin.planner.cli import basic as cmd_basic
from zeppelin.planner.cli import data as cmd_data
from zeppelin.planner.cli import plan as cmd_plan
from zeppelin.planner.cli import profile as cmd_profile
from zeppelin.planner.cli import run as cmd_run
from zeppelin.planner.cli import sim as cmd_sim
from zeppelin.schemas.common import InputError
from zeppelin.schemas.io.safefiles import tracking_inputs
from zeppelin.schemas.io.signals import Terminated



def _flag_type(self, ctx) -> str | None:
    """A switch takes no value: help shows no type for it (typer labels every flag ``<bool>``)."""
    return None if self.is_flag else _option_type(self, ctx)


_option_type = typer.core.TyperOption.display_type_rich
typer.core.TyperOption.display_type_rich = _flag_type

app = typer.Typer(
    name="zeppelin",
    help=(
        "zeppelin: plan and run load-balanced LLM training on variable-length sequences.\n\n"
        "Typical flow: `zeppelin data stats MANIFEST` -> `zeppelin plan` -> `zeppelin simulate` / "
        "`zeppelin compare` -> `zeppelin run`. `zeppelin demo` runs the whole thing on built-in defaults."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)



data_app = typer.Typer(help="Inspect dataset manifests.", no_args_is_help=True)
app.add_typer(data_app, name="data")

app.command("demo")(cmd_basic.demo)
app.command("presets")(cmd_basic.presets)
app.command("config")(cmd_basic.config)
app.command("schema")(cmd_basic.schema)
data_app.command("stats")(cmd_data.stats)
app.command("plan")(cmd_plan.plan)
app.command("validate")(cmd_plan.validate)
app.command("simulate")(cmd_sim.simulate)
app.command("compare")(cmd_sim.compare)
app.command("check")(cmd_sim.check)
app.command("show")(cmd_sim.show)
app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(cmd_run.run)
app.command("profile", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    cmd_profile.profile
)
# the command list shows a docstring's first paragraph as one sentence (rich help keeps its line
# breaks, which cut sentences in the middle)
for _info in (*app.registered_commands, *data_app.registered_commands):
    _info.short_help = " ".join((_info.callback.__doc__ or "").split("\n\n")[0].split())


def fail(message: str, code: int = 2) -> None:
    """Print a one-line error and exit (used for bad input: exit code 2)."""
    print(f"zeppelin: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _click_exceptions():
    """The click exception classes the installed typer raises (typer >= 0.24 carries its own click)."""
    try:
        import typer._click.exceptions as cx
    except ImportError:  # older typer: click itself
        import click.exceptions as cx
    return cx


def _usage_line(e) -> str:
    """A click usage error as one line, with where to find help."""
    msg = " ".join(e.format_message().split())
    path = e.ctx.command_path if getattr(e, "ctx", None) is not None else "zeppelin"
    return f"{msg} (see `{path} --help`)"


def main(argv: list[str] | None = None) -> None:
    cx = _click_exceptions()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with tracking_inputs():  # outputs are checked against every file the command reads
            from zeppelin.planner.cli.jobfile import expand

            args = expand(args)  # --config JOB.toml: the job file's flags, before the command line's
            rv = app(args=args, prog_name="zeppelin", standalone_mode=False)
    except cx.NoArgsIsHelpError:
        app(args=[*args, "--help"], prog_name="zeppelin")  # a bare command group prints its help
        return
    except cx.UsageError as e:  # bad option, missing argument, value of the wrong type
        fail(_usage_line(e))
    except cx.ClickException as e:
        fail(" ".join(e.format_message().split()), e.exit_code or 2)
    except InputError as e:
        fail(str(e))
    except (KeyboardInterrupt, typer.Abort):
        print("zeppelin: interrupted", file=sys.stderr)
        raise SystemExit(130)
    except Terminated as e:  # SIGTERM/SIGHUP while writing a file: the temporary file is already removed
        print(f"zeppelin: {e}", file=sys.stderr)
        raise SystemExit(128 + e.signum)
    # like a standalone click program: always leave through SystemExit (typer.Exit(code) gives its code)
    raise SystemExit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
