"""Sphinx configuration of tmcore's documentation (``make docs``; tests/test_docs.py builds it
with warnings as errors).

The API reference is generated from the docstrings (autosummary: one page per public
name of each module's ``__all__``), written in numpydoc style and validated by numpydoc
at build time, so it cannot drift from the code. The guides are Markdown (MyST).
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import tmcore

project = "tmcore"
author = "tmcore contributors"
copyright = "tmcore contributors"  # noqa: A001  (Sphinx's name)
release = tmcore.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.mathjax",
    "numpydoc",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
html_theme = "alabaster"
html_static_path: list[str] = []
html_theme_options = {"description": "Tensor Memory for every array library",
                      "fixed_sidebar": True}

# API pages: one per public name; signatures without type hints (numpydoc's Parameters
# section carries the shapes and types).
autosummary_imported_members = True
autosummary_ignore_module_all = False  # a module page lists its __all__
autodoc_typehints = "none"
autodoc_default_options = {"member-order": "bysource"}
numpydoc_show_class_members = False  # the class template lists the members itself
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

# Docstring validation (numpydoc): every public callable of the algebra modules, the
# options, the layer and its stream, and the testing kit has a summary, its Parameters
# (with shapes), Returns and Raises. Not enforced: an extended summary, See Also and
# Examples everywhere (Examples are on the main functions and run as doctests,
# tests/test_docs.py), and GL01 (the summary starts on the line of the opening quotes,
# as everywhere in this code base).
numpydoc_validation_checks = {"all", "GL01", "ES01", "SA01", "EX01", "SS05", "RT02"}
numpydoc_validation_exclude = {
    # Module constants: their one-line ``#:`` comments are their docs.
    r"\.[A-Z][A-Z0-9_]+$",
    # Class attributes documented by a ``#:`` comment: the Layer's replaceable head
    # functions and switches (the functions themselves are validated as
    # tmcore.layer.linear and tmcore.layer.split) and LayerConfig's experimental fields
    # (described in LayerConfig's Parameters).
    r"^tmcore\.layer\.Layer\.(linear|softplus|split|flat_rows|sample)$",
    r"^tmcore\.layer\.LayerConfig\.(update|dynamics|flow)$",
}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


# The Hugging Face adapter's page (api_hf.rst) is built where the adapter imports
# (transformers installed); elsewhere it is left out, and the index's glob skips it.
autosummary_generate = ["api.rst"]
# autosummary writes the pages of what exists but never removes those of names that went:
# start from none, so a removed name's stale page cannot survive into the build
shutil.rmtree(Path(__file__).parent / "generated", ignore_errors=True)
if _importable("tmcore.adapters.hf"):
    autosummary_generate.append("api_hf.rst")
else:
    exclude_patterns.append("api_hf.rst")


def _skip_tuple_fields(app, what, name, obj, skip, options):
    """NamedTuple fields are documented in their class's Attributes section, not as
    members whose docstring is "Alias for field number 0"."""
    return True if type(obj).__name__ == "_tuplegetter" else None


# A class exported by several API modules (``StreamState`` by tmcore.layer
# and both adapters) is indexed on the first page that lists it; the others render it with
# :no-index: (one target per object, no duplicate descriptions).
_API_MODULES = ["tmcore", "tmcore.layer", "tmcore.adapters.torch",
                "tmcore.adapters.jax", "tmcore.adapters.hf", "tmcore.testing", "tmcore.backends"]
_seen: set[int] = set()
_no_index: list[str] = []
for _name in _API_MODULES:
    if not _importable(_name):
        continue
    _module = importlib.import_module(_name)
    for _member in getattr(_module, "__all__", []):
        _obj = getattr(_module, _member, None)
        if isinstance(_obj, type):
            if id(_obj) in _seen:
                _no_index.append(f"{_name}.{_member}")
            _seen.add(id(_obj))
autosummary_context = {"no_index": _no_index}


def setup(app):
    app.connect("autodoc-skip-member", _skip_tuple_fields)


myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
