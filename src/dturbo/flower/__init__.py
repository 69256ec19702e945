"""Run dturbo's algorithms on Flower (``pip install 'dturbo[flower]'``; flwr is pinned to 1.41.0).

Two ways (each module imports flwr; this package itself does not, its strategy and helpers load on first use):

* **In your own Flower app** (docs/flower-strategy.md): :class:`DTurboVBI` (and :class:`STC`, :class:`FedDST`, on
  :class:`DturboStrategy`) is a Message-API ``Strategy`` for your ServerApp, and :func:`fit`, :func:`evaluate` and
  :func:`count_samples` answer its messages in your ClientApp, on your model and your data
  (:mod:`dturbo.flower.strategy`, :mod:`dturbo.flower.client`, :mod:`dturbo.flower.protocol`).
* **dturbo's own app** (docs/flower.md), described below.

The Flower layer of dturbo's own app is glue only. :class:`~dturbo.flower.server_app.FlowerTransport` is a transport
(:mod:`dturbo.transport`) for the runner, :class:`~dturbo.sim.Simulator`: it sends the downlink bytes to the
SuperNodes as Flower Messages and returns their upload bytes; client selection, faults, the bit ledger,
aggregation, evaluation and the run directory stay in the Simulator. The ClientApp
(:mod:`dturbo.flower.client_app`) rebuilds the same configuration, data partition and client algorithm from
the configuration text the server sends, so the same bytes cross and ``metrics.csv`` equals the one of
``dturbo run`` for the same configuration and seed.

Modules (each imports flwr; this package itself does not):

* :mod:`dturbo.flower.wire`: how bytes and task information travel inside a Message;
* :mod:`dturbo.flower.server_app`: the ServerApp (``dturbo.flower.server_app:app``);
* :mod:`dturbo.flower.client_app`: the ClientApp (``dturbo.flower.client_app:app``);
* :mod:`dturbo.flower.inprocess`: a Grid that hands messages straight to the ClientApp (tests, debugging);
* :mod:`dturbo.flower.strategy`, :mod:`dturbo.flower.client`, :mod:`dturbo.flower.protocol`: the strategy and the
  client helpers for a user's own app.

The same ServerApp and ClientApp run on a deployment (SuperLink and SuperNodes) and on Flower's simulation
engine (``flwr run . local-sim``, the extra ``dturbo[simulation]``: Ray; one virtual SuperNode per client). See
docs/flower.md for both.
"""

from typing import TYPE_CHECKING, Any

FLWR_VERSION = "1.41.0"

if TYPE_CHECKING:
    from .client import count_samples, evaluate, fit
    from .strategy import STC, DturboStrategy, DTurboVBI, FedDST

__all__ = ["FLWR_VERSION", "STC", "DTurboVBI", "DturboStrategy", "FedDST", "count_samples", "evaluate", "fit"]

_LAZY = {"DTurboVBI": "strategy", "DturboStrategy": "strategy", "STC": "strategy", "FedDST": "strategy",
         "fit": "client", "evaluate": "client", "count_samples": "client"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
