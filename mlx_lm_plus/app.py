"""Wiring: model provider + prompt cache + engine + aiohttp server."""

import asyncio
import logging
import os
import signal
import sys

import mlx.core as mx
from aiohttp import web
from mlx_lm.server import get_system_fingerprint
from mlx_lm.utils import maybe_set_recommended_wired_limit

from mlx_lm_plus.models.cpu import log_blas
from mlx_lm_plus.native import log_kernels
from mlx_lm_plus.protocols.anthropic import AnthropicProtocol
from mlx_lm_plus.http.server import RUNNER_OPTIONS, Server, make_app
from mlx_lm_plus.cache.store import PromptStore, default_budget
from mlx_lm_plus.http.connections import LimitedRunner
from mlx_lm_plus.engine.engine import Engine
from mlx_lm_plus.engine.watchdog import HANG_EXIT_STATUS
from mlx_lm_plus.http.metrics import Metrics
from mlx_lm_plus.models.provider import ModelProvider
from mlx_lm_plus.models.served import resolve_default_model
from mlx_lm_plus.protocols.responses import ResponsesProtocol


def build(cli_args):
    """(engine, server) for these arguments; the engine is not started."""
    resolve_default_model(cli_args)
    model_provider = ModelProvider(cli_args)
    budget = cli_args.prompt_cache_bytes
    if budget is None:
        budget = default_budget()
        logging.info(
            f"Prompt cache budget: {budget / 1e9:.2f} GB (default: 20% of memory; "
            "--prompt-cache-bytes sets it)"
        )
    store = PromptStore(
        max_bytes=budget,
        max_sequences=cli_args.prompt_cache_size,
        ttl=cli_args.prompt_cache_ttl or None,
        bits=cli_args.prompt_cache_bits,
        group_size=cli_args.kv_group_size,
        share_kv=cli_args.kv_bits is None,
    )
    engine = Engine(model_provider, store)
    server = Server(cli_args, engine, model_provider, get_system_fingerprint())
    engine.arrivals = lambda: server.arriving
    server.add_protocol(AnthropicProtocol(not cli_args.keep_billing_header))
    server.add_protocol(ResponsesProtocol(
        max_responses=cli_args.responses_store_size,
        max_bytes=cli_args.responses_store_bytes,
        ttl=cli_args.responses_store_ttl or None,
    ))
    if not cli_args.disable_metrics:
        server.metrics = Metrics(engine, in_flight=lambda: server.in_flight,
                                 connections=server.connections)
        engine.metrics = server.metrics
    return engine, server


# Seconds the handlers of requests the engine answered at shutdown get to
# write their ends, and then aiohttp's cancelled ones to return.
SHUTDOWN_GRACE = 2.0


async def serve(server: Server, host: str, port: int, stop: asyncio.Event):
    # On stop the listening socket closes, the requests in flight get
    # --shutdown-timeout seconds to finish; then the engine stops and answers
    # those left with an error (a stream gets an error event and its end,
    # not a cut connection), and aiohttp closes what remains (a cancelled
    # handler cancels its request in the engine). aiohttp's own shutdown
    # waits its timeout twice (before and after cancelling): it is only
    # given the grace.
    runner = LimitedRunner(
        make_app(server),
        server.connections,
        handler_cancellation=True,
        access_log=None,
        **RUNNER_OPTIONS,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        await stop.wait()
    finally:
        logging.info(
            f"Stopping: {server.in_flight} request(s) in flight get up to "
            f"{server.cli_args.shutdown_timeout:g} s to finish"
        )
        await site.stop()
        # A new request on a keep-alive connection gets a 503 and the
        # connection closes (aiohttp's pre_shutdown would drop the bytes
        # still coming on every connection, bodies being uploaded included).
        server.stopping = True
        await _drain(server, server.cli_args.shutdown_timeout)
        # Bodies still coming get a 503 each (the runner's cleanup waits
        # for their handlers, up to the grace, before it closes anything).
        server.stop_receiving()
        if server.in_flight:
            server.engine.stop()  # (answers what it holds: EngineUnavailable)
            await _drain(server, SHUTDOWN_GRACE)
        await runner.cleanup()


async def _drain(server: Server, timeout: float):
    """Wait until no request is in flight, nor a body coming (one that sent
    a byte in the last second: a client that went quiet is not waited
    for), at most `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (server.in_flight or (server.reading and loop.time() - server.body_progress_at < 1.0)
           ) and loop.time() < deadline:
        await asyncio.sleep(0.05)


def run(cli_args):
    maybe_set_recommended_wired_limit()
    log_blas()
    log_kernels()
    engine, server = build(cli_args)
    engine.start()
    if mx.distributed.init().rank() != 0:
        # Other ranks only compute; rank 0 reads the HTTP requests. They stop
        # when rank 0 does (it tells them at a hand-off, once its requests
        # have drained): a signal to the whole group (mlx.launch's Ctrl-C)
        # must not take a rank from under rank 0's drain.
        signals = []

        def stop_with_rank_0(*_):
            # (A second one: rank 0 is gone or stuck, and this rank with it.)
            signals.append(1)
            if len(signals) > 1:
                logging.critical(f"Stopping now, without rank 0: exiting with status "
                                 f"{HANG_EXIT_STATUS}")
                logging.shutdown()
                engine.exit_process(HANG_EXIT_STATUS)
            logging.info("Stopping when rank 0 does (again to stop now)")

        # (SIGHUP too: a remote rank's ssh session hangs up on a Ctrl-C.)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop_with_rank_0)
        engine.join()
        if engine.hung:  # (the group is down: this rank exits as rank 0 does)
            engine.exit_process(HANG_EXIT_STATUS)
        _exit_cleanly()

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(server, cli_args.host, cli_args.port, stop)

    try:
        asyncio.run(main())
    finally:
        # With a disk tier the generation thread saves the prompt cache on
        # its way out, for up to --shutdown-timeout seconds more.
        saving = cli_args.shutdown_timeout if cli_args.prompt_cache_dir else 0
        engine.stop_and_join(timeout=10 + saving)
    _exit_cleanly()


def _exit_cleanly():
    logging.info("Server stopped")
    # Everything is shut down. Skip interpreter teardown: MLX's stream worker
    # threads, started from the generation thread, abort the process when the
    # runtime destroys them at exit ("terminate called without an active
    # exception"), which would turn a clean SIGTERM into exit status 134.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
