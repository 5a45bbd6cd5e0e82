"""A damaged delta for tests: vLLM imports this module into each worker (`--worker-extension-cls`), and importing it
flips one byte of the first sparse bucket's payload the worker receives (after the sender took its checksum, before
the worker applies it), once per server, as a link or a bug might. Slipstream must catch it (the checksum), never load
it, and receive that bucket again whole in the same update."""

from slipstream.weights.receive import delta_receive

_apply = delta_receive.apply
DAMAGED = {"done": False}


def _apply_damaged(header, payload, base, element_size) -> bool:
    if not DAMAGED["done"] and header.mode and header.count:
        DAMAGED["done"] = True
        payload = payload.clone()
        payload[-1] ^= 0x01
    return _apply(header, payload, base, element_size)


delta_receive.apply = _apply_damaged


class DamagedDelta:
    """The worker extension named on the command line: it adds nothing; importing this module is the damage."""
