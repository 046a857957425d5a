"""The API reference: one page per public package, one entry per name of its ``__all__``.

A package's ``__all__`` is its public face, so the reference documents exactly those names, each
once: a name re-exported by several faces (``thdpack.plan_packs`` is ``thdpack.plan.plan_packs``)
is rendered on the page of the package nearest to where it is defined and linked from the others.
``__all__`` and the imports are read from the source (``ast``), so building the reference imports
neither torch nor the optional dependencies; mkdocstrings renders each entry from the docstrings.
"""

from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Page:
    """One reference page: ``reference/api/<slug>.md``, titled ``thdpack.<slug with dots>``."""

    slug: str
    blurb: str
    """What the page is for: its first line, and its row in the index."""
    face: str | None = None
    """The module whose ``__all__`` the page documents, where it is not the title's."""

    @property
    def title(self) -> str:
        return "thdpack." + self.slug.replace("-", ".")

    @property
    def module(self) -> str:
        return self.face or self.title


# the order is the nav's and the pipeline's
PAGES: tuple[Page, ...] = (
    Page("layout", "The context-parallel layout, numpy only."),
    Page("plan", "Packing plans: which sequences share a pack, numpy only."),
    Page("packing", "Packs from samples and plans, and the datasets that serve them."),
    Page("thd", "THD batches: collate, to_thd, and their validation."),
    Page("cp", "Context parallelism's data side: shards and the topology."),
    Page("attention", "Exact attention over THD batches, on one rank or a CP group."),
    Page("loss", "The front door's names defined outside a stage package: the loss, IGNORE_INDEX.", "thdpack"),
    Page("models", "thdpack's reference decoder."),
    Page("models-hf", "Hugging Face causal LMs over THD batches."),
    Page("data", "Sources, tokenization, token stores."),
    Page("verify", "`thdpack verify` from Python."),
    Page("perf", "The step-time model, numpy only."),
    Page(
        "integrations",
        "transformers' Trainer and TRL's SFTTrainer with thdpack's packing, CP and loss.",
        "thdpack.integrations.transformers",
    ),
    Page("integrations-trl", "TRL's SFTTrainer, thdpack inside."),
    Page("compat-nemo", "NeMo AutoModel drop-ins."),
)
PAGE = {p.slug: p for p in PAGES}


@dataclass(frozen=True)
class Name:
    """One public name: the face that exports it (``module``) and the module that defines it."""

    name: str
    module: str
    source: str  # the defining module, or an outside package ("trl") for a re-export

    @property
    def internal(self) -> bool:
        return self.source == "thdpack" or self.source.startswith("thdpack.")


def module_path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(module_path(module).read_text())


def exported(module: str) -> tuple[str, ...]:
    """``module``'s ``__all__``, read from its source."""
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise ValueError(f"{module} has no __all__: give it one, or leave it out of docs/gen/api.py's PAGES")


def defining_module(module: str, name: str) -> str:
    """Where ``name`` of ``module`` is defined: followed through ``from x import name`` (under
    ``TYPE_CHECKING`` too), or ``module`` itself."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
            if not node.module.startswith("thdpack"):
                return node.module
            try:
                return defining_module(node.module, name)
            except FileNotFoundError:
                return node.module
    return module


def names(module: str) -> list[Name]:
    return [Name(n, module, defining_module(module, n)) for n in exported(module) if n != "__version__"]


@cache
def homes() -> dict[tuple[str, str], str]:
    """(defining module, name) -> the page that renders it: the first stage page whose face exports
    it; the front door's own page (``loss``) takes only what no stage package exports."""
    out: dict[tuple[str, str], str] = {}
    for page in sorted(PAGES, key=lambda p: p.slug == "loss"):
        for item in names(page.module):
            if item.internal:
                out.setdefault((item.source, item.name), page.slug)
    return out


def keyword_door(item: Name) -> str | None:
    """The ``FlatKeywords`` that writes ``item``'s keywords when its module loads (a door decorated
    ``@X.document``: ``plan_packs``, ``PackedDataset``, ``StreamingPacker``), by name, or None.
    mkdocstrings reads the source, where those keywords are ``**keywords``, so the entry links
    them in the config reference."""

    def door(node: ast.AST) -> str | None:
        for d in getattr(node, "decorator_list", []):
            if isinstance(d, ast.Attribute) and d.attr == "document" and isinstance(d.value, ast.Name):
                return d.value.id
        return None

    for node in _tree(item.source).body:
        if getattr(node, "name", None) == item.name:
            return door(node) or next((door(n) for n in getattr(node, "body", []) if door(n)), None)
    return None


def keywords_note(item: Name) -> str:
    """A line under a flat door's entry: its keywords are the fields of these configs."""
    from gen.config_reference import COMPONENTS

    keywords = getattr(importlib.import_module(item.source), keyword_door(item))
    public = {path.rpartition(".")[2]: path for path, _ in COMPONENTS}
    links = []
    for part in keywords.parts:
        name = part.config.__name__
        flat = "".join(f" (its `{field}` listed flat)" for field in part.flatten)
        links.append(f"[`{name}`](../config.md#{public[name].replace('.', '').lower()}){flat}")
    return f"\n`**keywords`: every field of {' and '.join(links)} by name (`help({item.name})` lists them).\n"


def _entry(item: Name, page: str) -> str:
    if not item.internal:
        return f"## `{item.module}.{item.name}`\n\n`{item.source}.{item.name}`, re-exported as it is.\n"
    home = homes()[(item.source, item.name)]
    if home != page:
        target = PAGE[home].module
        return (
            f"## `{item.module}.{item.name}`\n\nThe same object as "
            f"[`{target}.{item.name}`]({home}.md#{target}.{item.name}).\n"
        )
    entry = f"::: {item.module}.{item.name}\n"
    return entry + keywords_note(item) if keyword_door(item) else entry


def page(slug: str) -> str:
    lines = [f"# {PAGE[slug].title}\n", f"{PAGE[slug].blurb}\n"]
    if slug == "loss":
        lines.append(
            "These names are imported from `thdpack` itself: `thdpack.StepLoss`, "
            "`thdpack.packed_cross_entropy`, `thdpack.IGNORE_INDEX`.\n"
        )
        items = [n for n in names("thdpack") if homes().get((n.source, n.name)) == "loss"]
    else:
        items = names(PAGE[slug].module)
    lines += [_entry(item, slug) for item in items]
    return "\n".join(lines)


def front_door() -> str:
    """The reference's index: the front door's names, each linked to its entry, then the pages."""
    lines = [
        "# API reference\n",
        "Generated from the docstrings of the public names: each package's `__all__`. "
        "Everything else is internal and may change.\n",
        "## The front door: `import thdpack`\n",
        "`import thdpack` loads numpy, not torch; the names that need torch import on first use.\n",
        "| name | documented as |",
        "|---|---|",
    ]
    for item in names("thdpack"):
        home = homes()[(item.source, item.name)]
        target = PAGE[home].module
        lines.append(f"| `thdpack.{item.name}` | [`{target}.{item.name}`]({home}.md#{target}.{item.name}) |")
    lines += ["", "## The packages\n", "| package | what it holds |", "|---|---|"]
    lines += [f"| [`{p.title}`]({p.slug}.md) | {p.blurb} |" for p in PAGES]
    return "\n".join(lines) + "\n"


def pages() -> list[tuple[str, str]]:
    """``(path under docs/, Markdown)`` of every reference page."""
    return [("reference/api/index.md", front_door())] + [(f"reference/api/{p.slug}.md", page(p.slug)) for p in PAGES]
