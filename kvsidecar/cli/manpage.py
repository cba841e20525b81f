"""``--help-man``: the command's man page in roff, from its click options (kingpin's flag,
which Prometheus's exporters have): ``kvsidecar serve --help-man | man -l -``, or install
it with ``kvsidecar --help-man > /usr/local/share/man/man1/kvsidecar.1``.

Generated from the same click objects as ``--help``, so the two never disagree.
"""

from __future__ import annotations

import click

from kvsidecar import __version__
from kvsidecar.cli.options import print_and_exit
from kvsidecar.revision import build_date

# The exit codes of kvsidecar.cli.main's docstring (test_docs_commands checks the doc).
EXIT_STATUS = (
    ("0", "ok"),
    ("1", "nothing to show or the check failed (no segment up, a torn read, a child died)"),
    ("2", "usage error (bad option, missing directory, port in use)"),
)


def escape(text: str) -> str:
    """Text safe in a roff line: backslashes doubled, hyphens as minus signs (so options
    can be searched and copied), and no line starting with a control character."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + out if out.startswith((".", "'")) else out


def _option_lines(cmd: click.Command, ctx: click.Context) -> list[str]:
    lines: list[str] = []
    for param in cmd.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:  # hidden
            continue
        names, help_text = record
        lines += [".TP", f"\\fB{escape(names)}\\fR", escape(help_text or "")]
    return lines


def _walk(cmd: click.Command, path: list[str]) -> list[tuple[list[str], click.Command]]:
    out = [(path, cmd)]
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.commands):
            out += _walk(cmd.commands[name], [*path, name])
    return out


def _summary(cmd: click.Command) -> str:
    return cmd.get_short_help_str(limit=300).rstrip(".")


def _command_name(ctx: click.Context) -> str:
    """ "kvsidecar serve", whatever ran it (`python -m kvsidecar` too): the page is the
    installed command's."""
    parts: list[str] = []
    while ctx.parent is not None:
        parts.insert(0, ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(["kvsidecar", *parts])


def render(ctx: click.Context) -> str:
    """The man page of ``ctx``'s command: the group's lists every command and its options;
    a command's has its own."""
    from kvsidecar import settings

    cmd = ctx.command
    name = _command_name(ctx)
    page = name.replace(" ", "-")
    # The build date --version prints (the commit's): two renderings of one build are the
    # same page. Never today's: a build without a date has an empty date field, as
    # --version says `unknown`.
    built = build_date()
    date = f"{built[:4]}-{built[4:6]}-{built[6:8]}" if built[:8].isdigit() else ""
    lines = [
        f'.TH "{page.upper()}" 1 "{date}" "kvsidecar {__version__}" "User Commands"',
        ".SH NAME",
        f"{escape(page)} \\- {escape(_summary(cmd))}",
        ".SH SYNOPSIS",
        f"\\fB{escape(name)}\\fR "
        + ("\\fICOMMAND\\fR " if isinstance(cmd, click.Group) else "")
        + "[\\fIOPTIONS\\fR]",
        ".SH DESCRIPTION",
        escape(" ".join((cmd.help or "").split())),
        ".SH OPTIONS",
        *_option_lines(cmd, ctx),
    ]
    subs = _walk(cmd, [])[1:] if isinstance(cmd, click.Group) else []
    if subs:
        lines.append(".SH COMMANDS")
        for path, sub in subs:
            lines += [".SS", f"\\fB{escape(' '.join([name, *path]))}\\fR [\\fIOPTIONS\\fR]"]
            lines += [".PP", escape(_summary(sub))]
            with click.Context(sub, info_name=path[-1], parent=ctx) as sub_ctx:
                lines += _option_lines(sub, sub_ctx)
    # Every variable this command (or one below it) reads, from the one definition.
    used_by = {settings.DAEMON} if page == "kvsidecar-serve" else None
    lines.append(".SH ENVIRONMENT")
    for s in settings.ALL:
        if used_by is None or used_by & set(s.used_by):
            twin = f" (\\fB{escape(s.flag)}\\fR)" if s.flag else ""
            lines += [".TP", f"\\fB{escape(s.name)}\\fR{twin}", escape(s.meaning.replace("`", ""))]
    lines.append(".SH EXIT STATUS")
    for code, meaning in EXIT_STATUS:
        lines += [".TP", code, escape(meaning)]
    lines += [
        ".SH SEE ALSO",
        "docs/operations.md (deployment, every variable), docs/metrics.md (every series).",
    ]
    return "\n".join(lines) + "\n"


# Hidden, as in kingpin: for packagers, not in every --help.
HELP_MAN = print_and_exit(
    "--help-man", render, hidden=True, help="Print a man page (roff) and exit."
)
