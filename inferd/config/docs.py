"""The README's config reference, rendered from the declaration in `schema` so the docs cannot drift."""

from __future__ import annotations

from pathlib import Path

import msgspec

from inferd.config.schema import SECTIONS, CanaryGuard, ModelConfig, doc_extra, field_doc

README_BEGIN = "<!-- config reference: python -m inferd.config -->\n"
README_END = "<!-- end of config reference -->"


def _default_text(field: msgspec.structs.FieldInfo) -> str:
    default_doc = doc_extra(field).get("default_doc")
    if default_doc:
        return str(default_doc)
    if field.required:
        return "(required)"
    default = field.default
    if isinstance(default, tuple):
        default = list(default)
    return "`" + msgspec.json.encode(default).decode() + "`"


def reference_markdown() -> str:
    """The config reference as a Markdown table per section, from the declarations in `schema`."""
    out: list[str] = []
    tables: list[tuple[str, type[msgspec.Struct]]] = [*((f"[{name}]", cls) for name, cls in SECTIONS.items()),
                                                      ("[models.NAME]", ModelConfig),
                                                      ("[models.NAME.canary_guard]", CanaryGuard)]
    for title, cls in tables:
        out += [f"#### `{title}`", "", "| key | default | on SIGHUP | meaning |", "|---|---|---|---|"]
        for field in msgspec.structs.fields(cls):
            meta = field_doc(field)
            when = "applied" if doc_extra(field).get("live") else "restart"
            out.append(f"| `{field.name}` | {_default_text(field)} | {when} | "
                       f"{meta.description if meta else ''} |")
        out.append("")
    return "\n".join(out)


def update_readme(path: Path) -> None:
    """Replace the config reference between README's markers with a fresh one."""
    text = path.read_text(encoding="utf-8")
    head, _, rest = text.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    path.write_text(head + README_BEGIN + reference_markdown() + README_END + tail, encoding="utf-8")
