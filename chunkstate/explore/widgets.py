"""The interactive explorer: ipywidgets controls over ``views`` (chapter 03a).

``explorer()`` returns an ``Explorer`` that a notebook displays as its last expression: a row of
toggles for the view and the gate, sliders for the gate's strength, the chunk and split sizes,
the tile, the pieces and the token, a text box for the sequence lengths, and the view's figure as
a PNG image, redrawn whenever a control changes. Every view is also a plain function of
``views`` (what the notebook's other cells, nbval and the tests use); ipywidgets is imported here
only, when the explorer is built.
"""
from __future__ import annotations

import time

from . import views

DEFAULTS = dict(view="states", gate="gk", strength=0.1, chunk_size=16, split=2, lengths="72, 0, 9, 1, 46",
                position=50, tile=16, pieces=1)


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"40, 0, 23"`` -> (40, 0, 23); ValueError saying what is wrong otherwise."""
    try:
        lengths = tuple(int(part) for part in text.replace(";", ",").split(",") if part.strip())
    except ValueError:
        raise ValueError(f"sequence lengths must be whole numbers separated by commas, got {text!r}") from None
    if not lengths or any(L < 0 for L in lengths) or sum(lengths) < 1:
        raise ValueError(f"give at least one token, no negative length, got {text!r}")
    if sum(lengths) > views.MAX_TOKENS:
        raise ValueError(f"at most {views.MAX_TOKENS} tokens in all (the interpreter is slow), got {sum(lengths)}")
    return lengths


class Explorer:
    """The explorer's widgets: ``controls`` (name -> widget), ``image`` (the figure, PNG),
    ``status`` (what was drawn, or the error), ``ui`` (the whole box, what a notebook displays).
    ``settings()`` reads the controls; ``redraw()`` draws the chosen view again."""

    def __init__(self, K: int = 32, V: int = 32, seed: int = 0, **initial):
        import ipywidgets as w

        unknown = sorted(set(initial) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"explorer() got unknown settings {unknown}; it takes {sorted(DEFAULTS)}, K, V, seed")
        start = {**DEFAULTS, **initial}
        self.K, self.V, self.seed = K, V, seed
        wide = w.Layout(width="420px")
        style = {"description_width": "125px"}
        self.controls = dict(
            view=w.ToggleButtons(options=list(views.VIEWS), value=start["view"], description="view", style=style),
            gate=w.ToggleButtons(options=list(views.GATE_KINDS), value=start["gate"], description="gate",
                                 style=style),
            strength=w.FloatSlider(value=start["strength"], min=0.0, max=1.0, step=0.01, description="gate strength",
                                   continuous_update=False, layout=wide, style=style),
            chunk_size=w.SelectionSlider(options=[16, 32, 64], value=start["chunk_size"], description="chunk BT",
                                         continuous_update=False, layout=wide, style=style),
            split=w.SelectionSlider(options=[1, 2, 4], value=start["split"], description="split BS / BT",
                                    continuous_update=False, layout=wide, style=style),
            tile=w.SelectionSlider(options=[16, 32], value=start["tile"], description="tile BK = BV",
                                   continuous_update=False, layout=wide, style=style),
            pieces=w.IntSlider(value=start["pieces"], min=1, max=4, description="pieces", continuous_update=False,
                               layout=wide, style=style),
            lengths=w.Text(value=start["lengths"], description="sequence lengths", continuous_update=False,
                           layout=wide, style=style),
            position=w.IntSlider(value=start["position"], min=0, max=max(sum(parse_lengths(start["lengths"])) - 1, 0),
                                 description="token", continuous_update=False, layout=wide, style=style),
        )
        self.controls["position"].add_class("chunkstate-position")
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.image.add_class("chunkstate-view")
        self.status = w.HTML()
        self.status.add_class("chunkstate-status")
        c = self.controls
        self.ui = w.VBox([c["view"], c["gate"], w.HBox([w.VBox([c["strength"], c["chunk_size"], c["split"]]),
                                                        w.VBox([c["tile"], c["pieces"]])]),
                          w.HBox([c["lengths"], c["position"]]), self.status, self.image])
        for control in c.values():
            control.observe(self._changed, names="value")
        self.redraws = 0
        self.redraw()

    def settings(self) -> dict:
        """The views' keyword arguments from the controls (ValueError for bad lengths)."""
        c = self.controls
        BT = c["chunk_size"].value
        return dict(lengths=parse_lengths(c["lengths"].value), gate=c["gate"].value, strength=c["strength"].value,
                    chunk_size=BT, split_size=BT * c["split"].value, position=c["position"].value,
                    K=self.K, V=self.V, tile=c["tile"].value, pieces=c["pieces"].value, seed=self.seed)

    def _changed(self, change):
        if change["owner"] is self.controls["lengths"]:
            try:
                T = sum(parse_lengths(change["new"]))
            except ValueError:
                T = None
            if T is not None:
                position = self.controls["position"]
                position.unobserve(self._changed, names="value")
                position.max = T - 1
                position.value = min(position.value, T - 1)
                position.observe(self._changed, names="value")
        self.redraw()

    def redraw(self) -> None:
        """Draw the chosen view for the current settings into ``image``; an error goes to ``status``."""
        start = time.perf_counter()
        try:
            settings = self.settings()
            figure = views.render(self.controls["view"].value, **settings)
            self.image.value = views.png(figure)
        except ValueError as err:
            self.status.value = f"<span style='color:#C44E52'>{err}</span>"
            return
        self.redraws += 1
        self.status.value = (f"<small>{self.controls['view'].value}: drawn in {time.perf_counter() - start:.2f} s "
                             f"(T = {sum(settings['lengths'])}, K = V = {self.K})</small>")

    def _repr_mimebundle_(self, **kwargs):
        return self.ui._repr_mimebundle_(**kwargs)


def explorer(K: int = 32, V: int = 32, seed: int = 0, **initial):
    """Build the explorer (module docstring); display it as a cell's last expression. ``initial``:
    starting values of the controls (``DEFAULTS``' names: view, gate, strength, chunk_size, split
    (BS / BT), lengths (text), position, tile, pieces). Without ipywidgets it says so (a warning
    naming what to install) and returns the starting view as a static matplotlib figure instead,
    so a notebook still runs."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        import warnings

        unknown = sorted(set(initial) - set(DEFAULTS))
        if unknown:
            raise TypeError(f"explorer() got unknown settings {unknown}; it takes {sorted(DEFAULTS)}, K, V, seed")
        warnings.warn("the explorer's sliders need ipywidgets (pip install -r requirements.txt installs it); "
                      "showing the starting view as a static figure", stacklevel=2)
        start = {**DEFAULTS, **initial}
        BT = start["chunk_size"]
        return views.render(start["view"], lengths=parse_lengths(start["lengths"]), gate=start["gate"],
                            strength=start["strength"], chunk_size=BT, split_size=BT * start["split"],
                            position=start["position"], K=K, V=V, tile=start["tile"], pieces=start["pieces"],
                            seed=seed)
    return Explorer(K=K, V=V, seed=seed, **initial)
