"""Error feedback at the client: what each client's uploads rounded off, added to its next upload (STC's residual
R_i; D-Turbo-VBI's ``up_quantizer = "sign"``).

One client object serves every client id in process, so the residuals are kept per id. A round is a pure function
of the residual it enters with: a retried round (``federation.on_too_few = "retry"``) starts again from the same
one instead of adding the rounding error twice. :meth:`ClientResiduals.export_state` / :meth:`import_state` carry
them through a checkpoint and the Flower ClientApp's node state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..protocol import ClientError


@dataclass
class Residual:
    round: int  # the round whose upload left ``after``
    before: np.ndarray | None  # the residual entering that round (None when restored from a checkpoint)
    after: np.ndarray  # flat


class ClientResiduals:
    """Each client's residual, a flat vector of ``size`` values in ``dtype``, with the round that left it."""

    def __init__(self, size: int, dtype: type[np.floating]) -> None:
        self.size, self.dtype = size, dtype
        self.by_client: dict[int, Residual] = {}

    def __getitem__(self, client_id: int) -> Residual:
        return self.by_client[client_id]

    def entering(self, client_id: int, round_idx: int) -> np.ndarray:
        """The residual at the start of ``round_idx``: zero in round 0 (a run starts clean, also in a reused process)
        and for a client that never sent; the one entering the round when the round is run again (a retry)."""
        e = self.by_client.get(client_id)
        if round_idx == 0 or e is None:
            return np.zeros(self.size, dtype=self.dtype)
        if e.round < round_idx:
            return e.after
        if e.round == round_idx and e.before is not None:
            return e.before
        raise ClientError(f"client {client_id}: holds the residual of round {e.round}, cannot run round {round_idx}")

    def record(self, client_id: int, round_idx: int, before: np.ndarray, after: np.ndarray) -> None:
        self.by_client[client_id] = Residual(round_idx, before, np.asarray(after, dtype=self.dtype))

    def export_state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for cid, e in sorted(self.by_client.items()):
            out[f"residual/{cid}"] = e.after
            out[f"residual_round/{cid}"] = np.array([e.round], dtype=np.int64)
        return out

    def import_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`export_state`; ValueError when a residual does not fit (its round missing, its length
        or dtype not the model's)."""
        self.by_client = {}
        for key, after in arrays.items():
            if not key.startswith("residual/"):
                continue
            cid = int(key.split("/", 1)[1])
            after = np.asarray(after)
            if after.dtype != self.dtype or after.shape != (self.size,):
                raise ValueError(f"the residual of client {cid} is {after.dtype} {after.shape}, the model needs "
                                 f"{np.dtype(self.dtype)} ({self.size},)")
            rounds = arrays.get(f"residual_round/{cid}")
            if rounds is None or np.asarray(rounds).size != 1:
                raise ValueError(f"the residual of client {cid} has no round")
            self.by_client[cid] = Residual(int(np.asarray(rounds).reshape(-1)[0]), None, after.copy())
