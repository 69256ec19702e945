"""Run dturbo's algorithms on Flower (``pip install 'dturbo[flower]'``; flwr is pinned to 1.41.0).

The Flower layer is glue only. :class:`~dturbo.flower.server_app.FlowerTransport` is a transport
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
* :mod:`dturbo.flower.inprocess`: a Grid that hands messages straight to the ClientApp (tests, debugging).

The same ServerApp and ClientApp run on a deployment (SuperLink and SuperNodes) and on Flower's simulation
engine (``flwr run . local-sim``, the extra ``dturbo[simulation]``: Ray; one virtual SuperNode per client). See
docs/flower.md for both.
"""

FLWR_VERSION = "1.41.0"
