"""MkDocs hooks: add the generated pages and pictures, and fill the ``{{ key }}`` placeholders.

Everything generated comes from the code (the API and config references, the concept pictures)
or from the JSON the benchmarks wrote (docs/performance/), at build time: it is never kept in git
and cannot drift. The generators live in docs/gen/.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gen import api, pictures, placeholders


def on_config(config):
    """The nav's API entry lists every page of the reference (docs/gen/api.py's ``PAGES``)."""
    for section in config.nav:
        if isinstance(section, dict) and "Reference" in section:
            for entry in section["Reference"]:
                if entry.get("API") == "reference/api/index.md":
                    entry["API"] = ["reference/api/index.md", *(f"reference/api/{p.slug}.md" for p in api.PAGES)]
    return config


def on_files(files: Files, config) -> Files:
    generated = [*api.pages(), *pictures.files()]
    for path, content in generated:
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    try:
        return placeholders.fill(markdown)
    except KeyError as err:
        raise PluginError(f"{page.file.src_uri}: {err.args[0]}") from err
