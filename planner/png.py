"""A small line-plot rasteriser writing PNG with zlib and struct (no plotting library).

:func:`plot_sweep` draws tokens/s against workers (or streams, when only they vary), log-log, one
line per other parameter (streams or round trip), with a 5x7 pixel font for the labels.
"""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

_GLYPHS = {  # 5 columns x 7 rows, '#' set
    "0": " ### #   ##  ### # ### #  ##   # ### ", "1": "  #   ##    #    #    #    #   ### ",
    "2": " ### #   #    #   #   #   #    #####", "3": "#####   #   #     #    ##   # ### ",
    "4": "   #   ##  # # #  # #####   #    # ", "5": "#####    ####     #    ##   # ### ",
    "6": "  ##  #   #    #### #   ##   # ### ", "7": "#####    #   #   #   #    #    #   ",
    "8": " ### #   ##   # ### #   ##   # ### ", "9": " ### #   ##   # ####    #   #  ##  ",
    ".": "                              ##   ", "-": "               ###               ",
    "/": "    #    #   #   #   #   #    #    ", " ": " " * 35, ",": "                         ##   #   ",
    "a": "      ###     # #### #   # ####    ", "c": "      ###  #    #    #   # ###     ".ljust(35),
    "e": "      ###  #   ######     ###      ".ljust(35), "k": "#    #    #  # # #  ##   # #  #  # ",
    "l": " ##    #    #    #    #    #   ### ", "m": "     ## # # # ## # ## # ## # #     ".ljust(35),
    "n": "     # ##  ##   ##   ##   ##   #   ".ljust(35), "o": "      ###  #   ##   ##   # ###     ".ljust(35),
    "p": "     #### #   ######  #    #       ".ljust(35), "r": "     # ##  ##   #    #    #        ".ljust(35),
    "s": "      #### #     ###      ####     ".ljust(35), "t": "  #    #   ###   #    #    #  #  ## ",
    "w": "     #   ##   ## # ## # ## # # # # ".ljust(35), "x": "     #   # # #   #   # # #   #     ".ljust(35),
    "b": "#    #    ####  #   ##   ##   #### ", "d": "    #    # #### #   ##   ##   # ####",
    "h": "#    #    # ##  ##   ##   ##   #   ", "i": "  #         ##    #    #    #   ### ",
    "u": "     #   ##   ##   ##   ##  ## ## #".ljust(35), "=": "          #####     #####          ",
}
_PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207),
            (140, 86, 75), (227, 119, 194)]


def write_png(path: str, img: np.ndarray) -> None:
    """``img``: (H, W, 3) uint8."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Canvas:
    def __init__(self, w: int, h: int):
        self.img = np.full((h, w, 3), 255, np.uint8)

    def dot(self, x: float, y: float, color, r: int = 1) -> None:
        h, w, _ = self.img.shape
        xi, yi = int(round(x)), int(round(y))
        self.img[max(0, yi - r):min(h, yi + r + 1), max(0, xi - r):min(w, xi + r + 1)] = color

    def line(self, x0, y0, x1, y1, color, r: int = 1) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, n):
            self.dot(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, color, r)

    def text(self, x: int, y: int, s: str, color=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.lower():
            g = _GLYPHS.get(ch, _GLYPHS[" "])
            for i, c in enumerate(g[:35]):
                if c == "#":
                    gx, gy = i % 5, i // 5
                    self.img[y + gy * scale:y + (gy + 1) * scale, x + gx * scale:x + (gx + 1) * scale] = color
            x += 6 * scale


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k" if v % 1000 == 0 else f"{v / 1000:.1f}k"
    return f"{v:g}" if v >= 1 else f"{v:.2g}"


def plot_sweep(rows: list[dict], path: str, title: str = "") -> None:
    """Tokens/s (log) against workers (log), one line per (streams, rtt) pair; against streams when
    workers do not vary."""
    if not rows:
        return
    xkey = "workers" if len({r["workers"] for r in rows}) > 1 else "streams"
    other = "streams" if xkey == "workers" else "workers"
    series: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault((r[other], r["rtt_ms"]), []).append((r[xkey], r["tokens_per_s"]))
    W, H, left, right, top, bottom = 1000, 640, 110, 250, 40, 80
    c = Canvas(W, H)
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts if y > 0]
    lx0, lx1 = math.log10(min(xs)), math.log10(max(xs)) if max(xs) > min(xs) else math.log10(min(xs)) + 1
    ly0, ly1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    if ly1 == ly0:
        ly1 += 1

    def px(x: float) -> float:
        return left + (math.log10(x) - lx0) / (lx1 - lx0 or 1) * (W - left - right)

    def py(y: float) -> float:
        return H - bottom - (math.log10(max(y, 10 ** ly0)) - ly0) / (ly1 - ly0) * (H - top - bottom)

    grey, black = (215, 215, 215), (0, 0, 0)
    for e in range(ly0, ly1 + 1):
        y = py(10 ** e)
        c.line(left, y, W - right, y, grey, 0)
        c.text(left - 12 * len(_fmt(10 ** e)) - 8, int(y) - 7, _fmt(10 ** e))
    for x in sorted(set(xs)):
        c.line(px(x), top, px(x), H - bottom, grey, 0)
        c.text(int(px(x)) - 6 * len(_fmt(x)), H - bottom + 10, _fmt(x))
    c.line(left, H - bottom, W - right, H - bottom, black, 0)
    c.line(left, top, left, H - bottom, black, 0)
    c.text(left + (W - left - right) // 2 - 42, H - 36, xkey)
    c.text(8, top - 30, "tok/s")
    if title:
        c.text(left + 40, 8, title[:60])
    for i, (key, pts) in enumerate(sorted(series.items())):
        color = _PALETTE[i % len(_PALETTE)]
        pts = sorted(pts)
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(px(x0), py(y0), px(x1), py(y1), color, 1)
        for x, y in pts:
            c.dot(px(x), py(y), color, 3)
        ly = top + 10 + 26 * i
        if ly < H - bottom:
            c.line(W - right + 14, ly + 7, W - right + 40, ly + 7, color, 2)
            c.text(W - right + 48, ly, f"{other[0]}={key[0]:g} rtt={key[1]:g}", scale=2)
    write_png(path, c.img)
