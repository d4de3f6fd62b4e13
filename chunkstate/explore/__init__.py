"""See the kernels work: a program map computed by the kernels' own parts, and views of the state
for an interactive explorer (chapter 03a).

- ``program_map(...)``: one row per program of a ``chunk_fwd_h`` / ``chunk_bwd_dh`` launch
  (``programs``); ``draw_program_map(table)`` draws it;
- ``state_heatmaps``, ``decay_weights``, ``gate_effects``, ``launch_map``: the explorer's views, each
  a plain function returning a matplotlib figure (``views``);
- ``explorer()``: the ipywidgets UI over them (``widgets``; ipywidgets is imported only there).

Nothing here imports matplotlib or ipywidgets until a figure or the UI is asked for.
"""
from .programs import COLUMNS, ProgramMap, draw_program_map, program_map, program_map_kernel
from .views import decay_weights, gate_effects, launch_map, state_heatmaps
from .widgets import explorer

__all__ = ["COLUMNS", "ProgramMap", "program_map", "program_map_kernel", "draw_program_map", "state_heatmaps",
           "decay_weights", "gate_effects", "launch_map", "explorer"]
