"""The JetStream stream that carries what the market pays from: ledger, routing, quarantine.

One stream, ``KVASIR_LEDGER``, captures ``kvasir.*.ledger``, ``kvasir.*.routing`` and
``kvasir.*.quarantine`` in the order the server received them. The backbone publishes its
routing statistics (with the rows each worker's reply won) *before* the ledger events of those
wins, and a quarantine event before the ledger events that follow it, so the market, reading the
stream in order, always knows the bound before the claim and the verdict before the pay.

* The backbone publishes with a ``Nats-Msg-Id`` (a batch id unique for all time): a re-sent
  batch inside the duplicate window is stored once.
* The market reads with one durable pull consumer (:data:`CONSUMER`) and explicit acks, acking
  a message only once its effect is committed in the ledger file (which also records the stream
  sequence it applied, so a redelivery after a crash between commit and ack counts nothing).
* File storage: a crashed backbone's stored events and a restarted market's unread ones survive.

Both sides call :func:`ensure_stream` (idempotent); whoever comes first creates the stream.
"""

from __future__ import annotations

from kvasir_bus import subjects

STREAM = "KVASIR_LEDGER"
CONSUMER = "kvasir-market"          # one market per bus, as the market's subjects assume
SUBJECTS = (subjects.ALL_LEDGER, subjects.ALL_ROUTING, subjects.ALL_QUARANTINE)
MSG_ID = "Nats-Msg-Id"
DUPLICATE_WINDOW_S = 600.0          # a backbone re-sends within this: stored once
MAX_AGE_S = 30 * 24 * 3600.0        # a market away longer than this loses the oldest events
MAX_BYTES = 1 << 30


def stream_config():
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(name=STREAM, subjects=list(SUBJECTS), retention=RetentionPolicy.LIMITS,
                        storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=MAX_AGE_S,
                        max_bytes=MAX_BYTES, duplicate_window=DUPLICATE_WINDOW_S)


ACK_WAIT_S = 5.0  # a message delivered and not acked is delivered again this much later


def consumer_config(ack_wait_s: float = ACK_WAIT_S, max_ack_pending: int = 1024):
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    return ConsumerConfig(durable_name=CONSUMER, ack_policy=AckPolicy.EXPLICIT,
                          deliver_policy=DeliverPolicy.ALL, ack_wait=ack_wait_s,
                          max_ack_pending=max_ack_pending)


async def ensure_stream(js) -> None:
    """Create the stream if it does not exist (a no-op if it does, whoever created it)."""
    from nats.js.errors import NotFoundError

    try:
        await js.stream_info(STREAM)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(stream_config())
    except Exception:
        await js.stream_info(STREAM)  # created meanwhile by the other side: fine; else raise
