"""The config reference of docs/reference/config.md, rendered from the declarations in `schema` to stay true."""

from __future__ import annotations

from pathlib import Path

import msgspec

from inferd.config.schema import SECTIONS, CanaryGuard, ModelConfig, PipelineConfig, doc_extra, field_doc

BEGIN_MARKER = "<!-- config reference: python -m inferd.config -->\n"
END_MARKER = "<!-- end of config reference -->"


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    default_doc = doc_extra(field).get("default_doc")
    if default_doc:
        return str(default_doc)
    if field.required:
        return "(required)"
    default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    if isinstance(default, tuple):
        default = list(default)
    return "`" + msgspec.json.encode(default).decode() + "`"


def reference_markdown() -> str:
    """The config reference as a Markdown table per section, from the declarations in `schema`.

    Each section is a second-level heading: the reference sits under the page's own title.
    """
    out: list[str] = []
    tables: list[tuple[str, type[msgspec.Struct]]] = [*((f"[{name}]", cls) for name, cls in SECTIONS.items()),
                                                      ("[models.NAME]", ModelConfig),
                                                      ("[models.NAME.canary_guard]", CanaryGuard),
                                                      ("[pipelines.NAME]", PipelineConfig)]
    for title, cls in tables:
        out += [f"## `{title}`", "", "| key | default | on SIGHUP | meaning |", "|---|---|---|---|"]
        for field in msgspec.structs.fields(cls):
            meta = field_doc(field)
            live = doc_extra(field).get("live")
            when = live if isinstance(live, str) else "applied" if live else "restart"
            out.append(f"| `{field.name}` | {_default_text(field)} | {when} | "
                       f"{meta.description if meta else ''} |")
        out.append("")
    return "\n".join(out)


def _split(path: Path) -> tuple[str, str, str]:
    """The text of `path` before the reference (markers excluded), the reference, and after it."""
    text = path.read_text(encoding="utf-8")
    head, begin, rest = text.partition(BEGIN_MARKER)
    reference, end, tail = rest.partition(END_MARKER)
    if not begin or not end:
        raise SystemExit(f"{path} has no config reference markers ({BEGIN_MARKER.strip()} ... {END_MARKER})")
    return head, reference, tail


def update_reference(path: Path) -> None:
    """Replace the config reference between the markers in `path` with a fresh one."""
    head, _, tail = _split(path)
    path.write_text(head + BEGIN_MARKER + reference_markdown() + END_MARKER + tail, encoding="utf-8")


def reference_is_current(path: Path) -> bool:
    """Whether the config reference between the markers in `path` is the one the declarations make."""
    return _split(path)[1] == reference_markdown()
