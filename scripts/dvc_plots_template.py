"""Write scripts/dvc_plots_offline.html: DVC's plots page with vega, vega-lite and vega-embed inlined.

``dvc plots show`` fills an HTML template with one ``vegaEmbed`` call per plot; its own
template loads the three libraries from a CDN, so the page is blank offline. This template
carries them inside the page instead (``.dvc/config``: ``plots.html_template``), at the versions
DVC 3's renderer (dvc-render 1.0) loads, so DVC's vega-lite v5 specs render as they would online.
It leaves out DVC's ``{scripts}`` placeholder, where the CDN tags would go.

Rerun it only to change the versions (needs ``npm``, which fetches the packages from the npm
registry)::

    python scripts/dvc_plots_template.py [--tarballs DIR]   # DIR: npm pack's .tgz files, else fetched

The libraries are BSD-3-Clause (University of Washington Interactive Data Lab); their licence
texts go into the page beside them.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().with_name("dvc_plots_offline.html")
# (npm package, version, the standalone build inside its tarball)
LIBRARIES = (("vega", "5.20.2", "build/vega.min.js"), ("vega-lite", "5.2.0", "build/vega-lite.min.js"),
             ("vega-embed", "6.18.2", "build/vega-embed.min.js"))
PLACEHOLDERS = ("{plot_divs}", "{scripts}", "{refresh_tag}")  # what dvc-render substitutes in the page
STYLE = "body{font-family:sans-serif;margin:1.5em}div.vega-embed{margin:0 1em 2em 0}"


def member(tgz: Path, name: str) -> str:
    with tarfile.open(tgz) as tar:
        f = tar.extractfile(f"package/{name}")
        if f is None:
            raise ValueError(f"{tgz}: no package/{name}")
        return f.read().decode("utf-8")


def inline_script(js: str) -> str:
    """``js`` made safe inside a ``<script>`` element (no closing tag or comment opener in it)."""
    for p in PLACEHOLDERS:
        if p in js:
            raise ValueError(f"the script contains DVC's placeholder {p}")
    return js.replace("</script", "<\\/script").replace("<!--", "<\\!--")


def build(tarballs: Path) -> str:
    scripts, notices = [], []
    for name, version, path in LIBRARIES:
        tgz = tarballs / f"{name}-{version}.tgz"
        js = member(tgz, path)
        sha = hashlib.sha256(js.encode()).hexdigest()
        notices.append(f"{name} {version} ({path}, sha256 {sha}):\n{member(tgz, 'LICENSE').strip()}")
        scripts.append(f"<script>/* {name} {version} */\n{inline_script(js)}\n</script>")
    head = ("<!-- DVC plots page for rayforge, written by scripts/dvc_plots_template.py: "
            + ", ".join(f"{n} {v}" for n, v, _ in LIBRARIES) + " inlined, so it opens offline.\n\n"
            + "\n\n".join(notices).replace("--", "- -") + "\n-->")
    return "\n".join(["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">', "{refresh_tag}",
                      "<title>DVC plots</title>", head, *scripts, f"<style>{STYLE}</style>", "</head>", "<body>",
                      "{plot_divs}", "</body>", "</html>", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tarballs", type=Path, help="folder with <name>-<version>.tgz from `npm pack` (default: fetch)")
    ap.add_argument("--out", type=Path, default=OUT, help=f"the template to write (default {OUT})")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.tarballs
        if folder is None:
            folder = Path(tmp)
            specs = [f"{n}@{v}" for n, v, _ in LIBRARIES]
            subprocess.run(["npm", "pack", "--silent", *specs], cwd=folder, check=True, stdout=subprocess.DEVNULL)
        page = build(folder)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out} ({len(page) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
