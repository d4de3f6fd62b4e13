"""The program map (chapters 05, 06, 11 and the README): what each program of a launch walks and
stores, computed by the kernels' own parts (``chunkstate.explore.program_map``), for a packed batch
and for one sequence cut into pieces. ``main(out_dir)`` saves it as ``program_map.png``.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..explore import draw_program_map, program_map
from . import save

PACKED = dict(B=1, T=97, H=2, K=128, V=128, cu_seqlens=[0, 20, 20, 64, 65, 97], chunk_size=16)
PIECES = dict(B=1, T=768, H=2, K=128, V=128, chunk_size=64, split_size=128, pieces=3)


def draw_program_maps(sms: int = 132):
    """Top: a packed batch (lengths 20, 0, 44, 1, 32; H = 2; K = V = 128 in 64 × 64 tiles; BT = 16):
    chapter 06's layout as the kernel computes it. Bottom: one sequence of 768 tokens cut into 3
    pieces (BT = 64, BS = 128), the launch that stores the states, against ``sms`` multiprocessors."""
    packed, pieces = program_map(**PACKED), program_map(**PIECES)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10.5, 11.5), gridspec_kw={"height_ratios": [len(packed), len(pieces)]})
    draw_program_map(packed, ax=ax, title=f"a packed batch, lengths 20, 0, 44, 1, 32 (H = 2, K = V = 128, "
                                           f"tiles 64×64, BT = BS = 16): {len(packed)} programs")
    draw_program_map(pieces, sms=sms, ax=ax2, title="one sequence of 768 tokens in 3 pieces (H = 2, K = V = 128, "
                                                    "tiles 64×64, BT = 64, BS = 128): the states' pass")
    fig.tight_layout()
    return fig


def main(out_dir) -> list:
    """Draw this module's figure into ``out_dir``; return its path."""
    return [save(draw_program_maps(), "program_map.png", out_dir)]
