#!/usr/bin/env python3
"""Maintainer tool: (re)build the bundled page corpus in examples/documents/.

Run once by a maintainer; the result (PNG pages, SOURCES.md, ground_truth.json)
is committed, so nothing at build, test or run time needs this script.

It rasterises two real, freely licensed PDFs that Debian ships:

    /usr/share/doc/libtasn1-doc/libtasn1.pdf                  (apt install libtasn1-doc)
    /usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf  (apt install shared-mime-info)

to 8-bit grayscale PNG at 120 DPI with pypdfium2, and (optionally) copies the
scanned page sample ``skimage/data/page.png`` (same pixels, ICC chunk dropped)
out of a scikit-image wheel (``pip download scikit-image==0.26.0 --no-deps``).

Each input is checked against the SHA-256 recorded below, so a different
Debian/scikit-image version fails loudly instead of silently changing the
pages that ground_truth.json describes. ``--force`` skips that check (then
re-verify with examples/check_ground_truth.py and update SOURCES.md).

Usage (from the repository root)::

    .venv/bin/python examples/make_corpus.py \\
        --skimage-wheel /tmp/scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl

Without ``--skimage-wheel`` the scanned sample is left as it is (or skipped).
Output is deterministic: the same inputs give byte-identical PNGs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import zipfile
from pathlib import Path

DPI = 120  # ~1017 x 1316 px for a US-letter page; see SOURCES.md for why
OUT_DIR = Path(__file__).resolve().parent / "documents"

# prefix -> (pdf path, sha256, pages to take (1-based, inclusive ranges))
PDF_SOURCES: dict[str, tuple[str, str, list[tuple[int, int]]]] = {
    # GNU Libtasn1 manual, all 36 pages. All of them, title page included, so the
    # corpus holds a complete verbatim copy (with the GFDL text, pages 27-34) as
    # the GFDL asks; the title page is sparse but not blank.
    "libtasn1": (
        "/usr/share/doc/libtasn1-doc/libtasn1.pdf",
        "3917eb460d87e275f9792b3597029873fd77890ed3ccebe40bbc5a3a7ee516d3",
        [(1, 36)],
    ),
    # freedesktop.org Shared MIME-info Database spec 0.21, 17 pages, all body text
    "mime-spec": (
        "/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf",
        "4d9666c46b4d367a12e2922f4f3b114396c377106c57bbc934d03320e6888002",
        [(1, 17)],
    ),
}

SKIMAGE_MEMBER = "skimage/data/page.png"
SKIMAGE_PAGE_SHA256 = "341a6f0a61557662b02734a9b6e56ec33a915b2c41886b97509dedf2a43b47a3"
SKIMAGE_OUT = "skimage-page.png"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def page_numbers(ranges: list[tuple[int, int]]) -> list[int]:
    return [n for lo, hi in ranges for n in range(lo, hi + 1)]


def rasterise(prefix: str, pdf_path: Path, pages: list[int], dpi: int, out_dir: Path) -> list[Path]:
    import pypdfium2 as pdfium

    written = []
    doc = pdfium.PdfDocument(str(pdf_path))
    try:
        for n in pages:
            page = doc[n - 1]
            text = page.get_textpage().get_text_range()
            if len(text.strip()) < 100:
                raise SystemExit(f"{pdf_path} page {n}: almost no text ({len(text.strip())} chars); not a body page")
            # grayscale=True -> 8-bit single-channel bitmap; no alpha, white background
            img = page.render(scale=dpi / 72, grayscale=True).to_pil()
            if img.mode != "L":
                img = img.convert("L")
            out = out_dir / f"{prefix}-p{n:03d}.png"
            img.save(out, format="PNG", optimize=True)
            written.append(out)
            print(f"{out.name}  {img.size[0]}x{img.size[1]}  {out.stat().st_size} bytes")
    finally:
        doc.close()
    return written


def copy_skimage_page(wheel: Path, out_dir: Path, force: bool) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(SKIMAGE_MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SKIMAGE_PAGE_SHA256 and not force:
        raise SystemExit(f"{wheel}:{SKIMAGE_MEMBER} sha256 {digest} != {SKIMAGE_PAGE_SHA256} (use --force)")
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.mode != "L":
        raise SystemExit(f"{SKIMAGE_MEMBER} is mode {img.mode}, expected 8-bit grayscale 'L'")
    # Re-encode the identical pixels without the ancillary chunks: the original
    # carries an iCCP chunk that makes libpng (and so cv2.imdecode) print
    # "iCCP: profile 'ICC Profile': 1000000h: invalid rendering intent" on every decode.
    out = out_dir / SKIMAGE_OUT
    Image.frombytes("L", img.size, img.tobytes()).save(out, format="PNG", optimize=True)
    if Image.open(out).tobytes() != img.tobytes():
        raise SystemExit(f"{out}: re-encoded pixels differ from {SKIMAGE_MEMBER}")
    print(f"{out.name}  {img.size[0]}x{img.size[1]}  {out.stat().st_size} bytes (pixels of {wheel.name}:{SKIMAGE_MEMBER})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output folder (default: %(default)s)")
    ap.add_argument("--dpi", type=int, default=DPI, help="render resolution (default: %(default)s)")
    ap.add_argument("--skimage-wheel", type=Path, help="scikit-image 0.26.0 wheel holding skimage/data/page.png")
    ap.add_argument("--force", action="store_true", help="accept inputs whose SHA-256 differs from the recorded one")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for prefix, (path, want, ranges) in PDF_SOURCES.items():
        pdf = Path(path)
        if not pdf.exists():
            raise SystemExit(f"{pdf} not found; install the Debian package named in SOURCES.md")
        got = sha256_file(pdf)
        if got != want and not args.force:
            raise SystemExit(f"{pdf}: sha256 {got} != recorded {want} (different package version?); use --force")
        total += len(rasterise(prefix, pdf, page_numbers(ranges), args.dpi, args.out))
    if args.skimage_wheel:
        copy_skimage_page(args.skimage_wheel, args.out, args.force)
        total += 1
    size = sum(p.stat().st_size for p in args.out.glob("*.png"))
    print(f"{total} pages written; {len(list(args.out.glob('*.png')))} PNGs in {args.out}, {size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
