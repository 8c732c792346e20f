"""A recovering replica group receives a peer's state as loom reads a checkpoint: tensors and
plain containers only, and no more bytes than a state of its own size could take
(`loom.trainer.ft_transport`); torchft's own receive would run what a hostile peer sends."""

from __future__ import annotations

import io
import os
import pickle
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from torch.distributed._serialization import _streaming_save

pytest.importorskip("torchft")

from torchft.checkpointing.http_transport import HTTPTransport

from loom.trainer.ft_transport import TooLarge, checked_transport

TIMEOUT = timedelta(seconds=10)


def stepped_states() -> dict:
    """What loom and DiLoCo register: optimizer and schedule state dicts after a step."""
    w = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    inner = torch.optim.AdamW([w], lr=1e-3)
    outer = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0)
    w.grad = torch.ones_like(w)
    inner.step(), outer.step(), schedule.step()
    return {"user": {"loom": {"model": {"w": w.detach()}, "optim": inner.state_dict(),
                              "scheduler": schedule.state_dict(),
                              "loop": {"step": 4, "tokens_seen": 128, "samples_seen": 4}},
                     "StreamingDiLoCoFragment_0": {"outer_optimizer": outer.state_dict(),
                                                   "original_parameters": {"w": w.detach()}}},
            "torchft": {"step": 4, "batches_committed": 8}}


STATE = stepped_states()


def test_a_peers_state_arrives_whole() -> None:
    sender = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    try:
        sender.send_checkpoint(dst_ranks=[1], step=4, state_dict=STATE, timeout=TIMEOUT)
        got = checked_transport(TIMEOUT, lambda: 1 << 20).recv_checkpoint(
            0, sender.metadata(), 4, TIMEOUT)
        assert torch.equal(got["user"]["loom"]["model"]["w"], STATE["user"]["loom"]["model"]["w"])
        assert got["torchft"] == STATE["torchft"] and got["user"]["loom"]["loop"]["step"] == 4
        assert got["user"]["loom"]["scheduler"] == STATE["user"]["loom"]["scheduler"]
        outer = got["user"]["StreamingDiLoCoFragment_0"]["outer_optimizer"]
        assert outer["param_groups"] == STATE["user"]["StreamingDiLoCoFragment_0"][
            "outer_optimizer"]["param_groups"]
        assert torch.equal(outer["state"][0]["momentum_buffer"], torch.ones(2, 3))
        with pytest.raises(TooLarge):  # the same state, over a budget too small for it
            checked_transport(TIMEOUT, lambda: 64).recv_checkpoint(0, sender.metadata(), 4,
                                                                  TIMEOUT)
    finally:
        sender.shutdown(wait=False)


class Planted:
    """What a hostile server sends: unpickling it makes a folder."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


def serve(payload: bytes) -> tuple[HTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/checkpoint/"


def test_a_hostile_peer_runs_nothing(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "torchft"
    for marker, transport in ((ours, checked_transport(TIMEOUT, lambda: 1 << 20)),
                              (theirs, HTTPTransport(timeout=TIMEOUT, num_chunks=0))):
        payload = io.BytesIO()  # torchft's wire format (torch's streaming save)
        _streaming_save({"user": Planted(marker)}, payload)
        server, address = serve(payload.getvalue())
        try:
            if marker is ours:
                with pytest.raises(pickle.UnpicklingError):
                    transport.recv_checkpoint(0, address, 4, TIMEOUT)
            else:
                transport.recv_checkpoint(0, address, 4, TIMEOUT)
        finally:
            server.shutdown()
    assert not ours.exists(), "the checked receive unpickled a callable"
    assert theirs.exists(), "torchft's own receive no longer runs it: the test shows nothing"
