"""A self-contained HTML page: escaped text, pandas tables, matplotlib figures inlined as SVG.

Nothing is loaded from outside the file (no scripts, fonts or stylesheets), so a report opens
offline and can be mailed around. Every string that reaches the page goes through
:func:`html.escape` (or pandas' escaping for tables, matplotlib's for SVG text).
"""

from __future__ import annotations

import html
import io
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field

import matplotlib
import pandas as pd

from ..io import write_text_atomic
from .plots import PolicyStyle, policy_styles

__all__ = ["Page", "svg_of"]

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1180px;
       padding: 16px 28px 60px; color: #1d2430; }
h1 { font-size: 24px; margin-bottom: 4px; } h2 { font-size: 19px; margin-top: 36px; border-bottom: 1px solid #d8dde6; }
h3 { font-size: 15px; margin-top: 22px; }
table { border-collapse: collapse; margin: 8px 0 14px; font-size: 13px; }
th, td { border: 1px solid #d8dde6; padding: 3px 8px; text-align: right; }
th { background: #f2f4f8; } td:first-child, th:first-child { text-align: left; }
figure { margin: 10px 0 18px; } figcaption { color: #5a6475; font-size: 12.5px; }
figure svg { max-width: 100%; height: auto; }   /* narrower with the window, its shape kept (its viewBox) */
h1, h2, h3, p, nav, figcaption { overflow-wrap: break-word; }       /* a long unbroken name wraps at the edge */
.meta { color: #5a6475; font-size: 12.5px; } .note { background: #fff7e0; padding: 6px 10px; border-left: 3px solid #e0b040; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f5f6f8; padding: 8px; overflow-x: auto; }
nav a { margin-right: 14px; }
.wide { overflow-x: auto; }
table.dense { font-size: 12px; } table.dense th, table.dense td { padding: 2px 5px; }
@media print { body { max-width: none; padding: 0; } .wide { overflow: visible; }
               table { font-size: 10px; } }
"""

# a table of more columns than this is set denser (smaller type, less padding) to fit the page
DENSE_ABOVE = 10
# a text column whose values are all this short never wraps (a name on one line, not one word a line)
NOWRAP_UP_TO = 24


_TABLE_START = '<div class="wide">'

# the metadata matplotlib writes into an SVG unless told not to
_SVG_METADATA = ("Date", "Format", "Type", "Creator")
# where an SVG names an id of its own: the id, a link to it, a paint or clip path that refers to it
_SVG_ID_USE = re.compile(r'(\bid="|href="#|url\(#)([^")]+)')


def svg_of(fig) -> str:
    """A matplotlib :class:`~matplotlib.figure.Figure` (made without pyplot, so nothing needs a
    display or closing) as inline SVG markup."""
    buf = io.StringIO()
    with warnings.catch_warnings():
        # a label in a script the bundled font lacks (CJK, say) draws boxes: the page's tables
        # have the text, and a warning per glyph would drown the command's output ("missing from
        # current font" before matplotlib 3.9, "missing from font(s) NAME" since)
        warnings.filterwarnings("ignore", message="Glyph .* missing from (current )?font", category=UserWarning)
        # the same figure gives the same bytes: no date, element ids from a fixed salt (not random);
        # and no metadata block at all, whose RDF elements (dc:, cc:) an HTML page cannot hold
        with matplotlib.rc_context({"svg.hashsalt": "specfit"}):
            fig.savefig(buf, format="svg", bbox_inches="tight", metadata=dict.fromkeys(_SVG_METADATA))
    text = buf.getvalue()
    # a glyph with no outline (a space's) is a path with no d, which SVG 1.1 (the Nu checker's) requires
    text = re.sub(r"<path (?![^>]*\bd=)", '<path d="" ', text)
    return text[text.index("<svg"):]  # drop the XML prolog and doctype


def _own_ids(svg: str, prefix: str) -> str:
    """``svg`` with every id it defines (and every reference to one) prefixed by ``prefix``.
    matplotlib names the parts of every figure alike (``figure_1``, ``axes_1``, a glyph, a clip
    path): a page of many figures held each id once per figure, which an HTML document may not
    (and a reference resolved to the first figure's element). An id matplotlib gives twice in one
    figure (an image's is its pixels' hash: a sweep's panels of equal tokens/s) is numbered from
    its second on; a reference lands on the first, the same content."""
    ids = set(re.findall(r'\bid="([^"]+)"', svg))
    given = Counter()

    def own(m: re.Match) -> str:
        start, name = m.groups()
        if name not in ids:
            return m.group(0)
        if start == 'id="':
            given[name] += 1
            if given[name] > 1:
                return f"{start}{prefix}{name}-{given[name]}"
        return start + prefix + name

    return _SVG_ID_USE.sub(own, svg)


def _cells(table_id: str, df: pd.DataFrame, first: int, columns) -> str:
    """The CSS selector of the cells (head and body) of ``columns`` of the table ``table_id``."""
    numbers = [first + list(df.columns).index(c) for c in columns]
    return ", ".join(f"#{table_id} td:nth-child({k}), #{table_id} th:nth-child({k})" for k in numbers)


@dataclass
class Page:
    title: str
    parts: list[str] = field(default_factory=list)
    toc: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)      # what the page left out and why, for the command to say
    policies: dict[str, PolicyStyle] = field(default_factory=dict)   # each policy's look in every figure of the page
    styles: list[str] = field(default_factory=list)     # the tables' own rules, for the page's head

    def policy_styles(self, policies) -> dict[str, PolicyStyle]:
        """Each policy's colour, marker and line style on this page: those it was first given (in
        page order), in every figure of every section."""
        self.policies = policy_styles(policies, self.policies)
        return self.policies

    def policy_colors(self, policies) -> dict[str, str]:
        """Each policy's colour on this page (:meth:`policy_styles`), for bars, which have no marker."""
        return {policy: style.color for policy, style in self.policy_styles(policies).items()}

    def note(self, text: str) -> "Page":
        """Say on the page, and to whoever renders it (:attr:`notes`), what was left out and why."""
        self.notes.append(text)
        return self.paragraph(f"note: {text}", css="note")

    def heading(self, text: str, level: int = 2) -> "Page":
        anchor = f"s{sum(part.startswith('<h') for part in self.parts)}"     # one id per heading of any level
        if level == 2:
            self.toc.append((anchor, text))
        self.parts.append(f'<h{level} id="{anchor}">{html.escape(text)}</h{level}>')
        return self

    def paragraph(self, text: str, css: str = "") -> "Page":
        cls = f' class="{html.escape(css)}"' if css else ""
        self.parts.append(f"<p{cls}>{html.escape(text)}</p>")
        return self

    def code(self, text: str) -> "Page":
        self.parts.append(f"<pre>{html.escape(text)}</pre>")
        return self

    def facts(self, items: dict) -> "Page":
        """A two-column table of labelled values."""
        rows = "".join(f'<tr><th scope="row">{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>'
                       for k, v in items.items())
        self.parts.append(f'<table class="facts">{rows}</table>')
        return self

    def table(self, df: pd.DataFrame, caption: str = "", float_format: str = "{:.4g}", index: bool = False,
              percent: tuple[str, ...] = ()) -> "Page":
        """``df`` as a table under ``caption``: its first sentence the table's heading, the rest
        (what the columns mean) in the page's small print. ``percent``: columns of shares, shown
        as percentages (``3.1%``, as the terminal shows them)."""
        if caption:
            title, _, rest = caption.partition(". ")
            self.parts.append(f"<h3>{html.escape(title if rest else caption)}</h3>")
            if rest:
                self.parts.append(f'<p class="meta">{html.escape(rest)}</p>')
        formatters = {c: float_format.format for c in df.columns if pd.api.types.is_float_dtype(df[c])}
        formatters.update({c: "{:+.1%}".format if "bias" in c else "{:.1%}".format for c in percent if c in df})
        table_id = f"t{sum(part.startswith(_TABLE_START) for part in self.parts)}"
        dense = ["dense"] if df.shape[1] + index > DENSE_ABOVE else []
        table = df.to_html(index=index, escape=True, border=0, formatters=formatters, na_rep="–", table_id=table_id,
                           classes=dense)
        # a field name in a header may break after its underscores (one word is as wide as its column)
        table = re.sub(r"(<th[^>]*>)([^<]*)", lambda m: m.group(1) + m.group(2).replace("_", "_<wbr>"), table)
        # numbers align right (the sheet's default), text columns left; short names on one line
        first = 2 if index else 1
        text = [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])]
        short = [c for c in text if max(len(str(c)), df[c].astype(str).str.len().max()) <= NOWRAP_UP_TO]
        # in the head: a <style> in the body is not HTML (browsers apply it; validators refuse it)
        self.styles += [f"{_cells(table_id, df, first, columns)} {{ {rule} }}"
                        for columns, rule in ((text, "text-align: left;"), (short, "white-space: nowrap;")) if columns]
        self.parts.append(f"{_TABLE_START}{table}</div>")
        return self

    def figure(self, fig, caption: str) -> "Page":
        """``fig`` under ``caption``, which is also its text alternative: the figure's text is drawn
        as paths, which a screen reader reads as nothing, so the SVG is one image named by its caption."""
        prefix = f"f{sum(part.startswith('<figure>') for part in self.parts)}_"      # one per figure of the page
        svg = _own_ids(svg_of(fig), prefix).replace("<svg ", f'<svg role="img" aria-labelledby="{prefix}caption" ', 1)
        self.parts.append(f'<figure>{svg}<figcaption id="{prefix}caption">{html.escape(caption)}</figcaption></figure>')
        return self

    def render(self) -> str:
        nav = " ".join(f'<a href="#{a}">{html.escape(t)}</a>' for a, t in self.toc)
        body = "\n".join(self.parts)
        styles = "\n".join(self.styles)
        return (
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"><title>{html.escape(self.title)}</title>"
            f"<style>{_STYLE}{styles}</style></head><body><h1>{html.escape(self.title)}</h1>"
            f"<nav>{nav}</nav>\n{body}\n</body></html>\n"
        )

    def save(self, path) -> None:
        write_text_atomic(path, self.render())
