"""A preparation cluster: each batch decoded and transformed on a worker of a dask.distributed
cluster instead of the loader's own threads (``ShardLoader(..., prep="tcp://scheduler:8786")``).

The loader still plans, reads and shuffles (its reader thread: little CPU); what costs CPU per
image, decoding and the transform, goes to the cluster. Each of the loader's decode threads
sends one batch task (the rows' encoded bytes and labels, with how to decode them: a
:class:`Recipe`) and waits for the finished batch, so ``num_threads`` batches are in flight at
most, and the ``prefetch`` queue bounds what waits on the training node, as without ``prep``.

Why the batches are the ones the loader would make itself: the worker runs the same
:func:`loaders.batch.decode_batch` on the same task, with the same decoder and the transform's
generator seeded by ``(seed, epoch, rank, batch index)``; nothing about the order, the state or
elastic resume changes. A worker killed while it holds a task loses nothing: the scheduler runs
the task again elsewhere (a pure function of its inputs, so the batch is the same). The
transform travels by reference (``pkg.module:name``, imported on the worker), never pickled;
credentials never travel (the workers read nothing: the bytes come with the task).

Each task carries the loader's :func:`code_identity` (the package version and a hash of the decode
path, the decoders present and the transform's module); a worker whose own differs, or that cannot
import the transform, answers with a refusal instead of a batch and the loader raises
:class:`ConfigError` naming the worker and both identities, whatever ``prep_fallback`` says.

Trust: the reply is unpickled in the training process (by ``distributed`` and here), so a worker
and the scheduler can run code there: the cluster is as trusted as the training node's own code.
``prep_security`` (dask's ``Security``, or the paths of a CA, a certificate and its key) makes
the connection TLS with certificates.

Decision and reasons: docs/design/0032-preparation-cluster.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import logging
import os
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lakeshard.errors import ConfigError, LoaderError
from loaders import batch as _batch_module
from loaders import decode as _decode_module
from loaders import transforms as _transforms_module
from loaders.batch import BatchTask, DecodeSpec, DecodeTarget, decode_batch, pinned
from loaders.decode import get_batch_decoder, get_decoder
from loaders.transforms import Transform, default_transform

__all__ = [
    "PrepCluster",
    "Recipe",
    "code_identity",
    "make_security",
    "prepare_batch",
    "resolve_reference",
    "transform_reference",
]

log = logging.getLogger(__name__)

#: How often a waiting decode thread looks at its stop event.
_POLL_S = 0.25


def resolve_reference(ref: str, *, what: str = "transform") -> Callable[..., Any]:
    """The callable ``pkg.module:name`` names (``name`` may be dotted: ``Class.method``).

    Raises:
        ConfigError: not of that form, or nothing callable there.
    """
    module, sep, name = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not sep or not module or not name:
        raise ConfigError(f"{what} must be a callable or 'pkg.module:name', got {ref!r}")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{what} {ref!r}: cannot import it: {type(exc).__name__}: {exc}") from None
    if not callable(target):
        raise ConfigError(f"{what} {ref!r} is not callable, got {type(target).__name__}")
    return target


def transform_reference(fn: Callable[..., Any]) -> str:
    """``pkg.module:name`` of a module-level transform function, checked to import back to it.

    Raises:
        ConfigError: ``fn`` cannot be found by reference (a lambda, a local function, an object,
            something defined in ``__main__``), naming what to do instead.
    """
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    hint = (
        "to run on a preparation cluster, a transform goes by reference: define it at module level in a "
        "module the workers can import and pass it (or 'pkg.module:name') as transform="
    )
    if not module or not name or "<" in name or module == "__main__":
        raise ConfigError(f"transform {fn!r} cannot be found by reference; {hint}")
    ref = f"{module}:{name}"
    try:
        found = resolve_reference(ref)
    except ConfigError:
        found = None
    if found is not fn:
        raise ConfigError(f"transform {fn!r} does not import back as {ref}; {hint}")
    return ref


@dataclass(frozen=True)
class Recipe(DecodeTarget):
    """What a worker needs to turn a batch task into the loader's batch: the target, and the
    decoder and transform by name or by value (a :class:`~loaders.batch.DecodeSpec` has them
    as functions, and the local buffers)."""

    decoder: str
    transform: str | None  #: ``pkg.module:name``; ``None``: the built-in options below
    augment: bool
    crop: int | None
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None


@functools.lru_cache(maxsize=16)
def code_identity(transform: str | None) -> str:
    """What must match between the loader and a worker for a batch to have the loader's pixels:
    ``"lakeshard <version> code <hash>"``, the hash over the sources of the decode path
    (:mod:`loaders.batch`, :mod:`loaders.decode`, :mod:`loaders.transforms`, this module), the
    decoders present (``loaders._jpeg``, simplejpeg, Pillow's version) and the source of
    ``transform``'s module (``pkg.module:name``, imported).

    Raises:
        ConfigError: ``transform`` cannot be imported here.
    """
    from PIL import __version__ as pillow

    digest = hashlib.sha256()
    modules = [_batch_module, _decode_module, _transforms_module, importlib.import_module(__name__)]
    if transform is not None:
        resolve_reference(transform)
        modules.append(importlib.import_module(transform.partition(":")[0]))
    for module in modules:
        digest.update(module.__name__.encode() + b"\0")
        file = getattr(module, "__file__", None)
        digest.update(Path(file).read_bytes() if file and os.path.isfile(file) else b"?")
    present = (_decode_module._jpeg is not None, _decode_module.has_simplejpeg(), pillow)
    digest.update(repr(present).encode())
    try:
        version = importlib.metadata.version("lakeshard")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: the hash still tells
        version = "(not installed)"
    return f"lakeshard {version} code {digest.hexdigest()[:16]}"


def prepare_batch(recipe: Recipe, task: BatchTask, code: str) -> bytes:
    """On a worker: the batch the loader would make of ``task``, and the rows it skipped,
    pickled here: Python's pickle keeps a tensor's strides (the loader's ``channels_last``
    images), where dask's own serializer of tensors makes them contiguous, and a model then
    computes in another order (other floats).

    A worker that cannot make the loader's batch answers with a refusal, a ``str``, instead of
    raising (the scheduler would run a failed task again, and the loader would read a
    configuration error as a cluster gone): ``code`` (the loader's :func:`code_identity`) is not
    its own, or the transform does not import here."""
    try:
        spec, here = _spec(recipe), code_identity(recipe.transform)
    except ConfigError as exc:
        return pickle.dumps(
            f"{_worker()}: {exc}; install it on the workers (their PYTHONPATH) as on the loader's node"
        )
    if here != code:
        return pickle.dumps(
            f"{_worker()} runs other code than the loader: the worker has {here}, the loader {code}; "
            "install the same lakeshard (and transform module) on the workers as on the loader's node"
        )
    skipped: list[Any] = []
    batch = decode_batch(task, _NEVER, _with_skipped(spec, skipped))
    return pickle.dumps((batch, skipped), protocol=5)


_NEVER = threading.Event()  # a worker's task is never stopped halfway: the future is cancelled instead


def _worker() -> str:
    """This dask worker, as the loader's messages name it."""
    try:
        from distributed import get_worker

        return f"prep worker {get_worker().address}"
    except (ImportError, ValueError):  # not in a worker: called directly
        return f"prep worker (pid {os.getpid()})"


@functools.lru_cache(maxsize=64)
def _spec(recipe: Recipe) -> DecodeSpec:
    transform: Transform | None
    if recipe.transform is not None:
        transform = resolve_reference(recipe.transform)
    else:
        transform = default_transform(augment=recipe.augment, crop=recipe.crop, normalize=recipe.normalize)
    return DecodeSpec(
        **recipe.target(),
        decoder=get_decoder(recipe.decoder),
        transform=transform,
        batch_decoder=get_batch_decoder(recipe.decoder),
    )


def _with_skipped(spec: DecodeSpec, skipped: list[Any]) -> DecodeSpec:
    """``spec`` (shared by a worker's tasks) reporting skipped rows to ``skipped``."""
    return dataclasses.replace(spec, skipped=skipped)


def make_security(value: Any) -> Any:
    """The ``distributed.security.Security`` of ``prep_security=``: the one given, or one made of
    ``{"ca_file": ..., "cert": ..., "key": ...}`` (PEM files: the CA the cluster's certificates
    are signed by, and this client's certificate and key; TLS required); ``None``: none.

    Raises:
        ConfigError: anything else, a file that is not there, or ``distributed`` not installed.
    """
    if value is None:
        return None
    Security = _distributed().security.Security
    if isinstance(value, Security):
        return value
    keys = ("ca_file", "cert", "key")
    if not isinstance(value, Mapping) or sorted(value) != sorted(keys):
        raise ConfigError(
            "prep_security must be a distributed.security.Security or a mapping of 'ca_file', 'cert' "
            f"and 'key' to PEM files, got {value!r}"
        )
    for key in keys:
        if not isinstance(value[key], str | os.PathLike) or not os.path.isfile(value[key]):
            raise ConfigError(
                f"prep_security[{key!r}]: no such file {value[key]!r}; give the path of a PEM file"
            )
    return Security(
        tls_ca_file=str(value["ca_file"]),
        tls_client_cert=str(value["cert"]),
        tls_client_key=str(value["key"]),
        require_encryption=True,
    )


def _distributed() -> Any:
    try:
        import distributed
        import distributed.security
    except ImportError:
        raise ConfigError(
            "prep= needs dask.distributed: pip install 'dask[distributed]' (the lakeshard[dask] extra)"
        ) from None
    return distributed


class _Quiet(logging.Filter):
    """Drops every record: set on ``distributed``'s loggers while the loader closes a client whose
    cluster went away (its reconnect task, cancelled, logs tracebacks of a run that worked)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


_QUIET_LOGGERS = ("distributed.client", "distributed.utils", "distributed.core")


class _OwnCommClosed(logging.Filter):
    """Drops ``distributed.batched``'s "Batched Comm Closed" record (INFO, with a traceback) about
    a loader client's own connection to its preparation cluster: logged whenever the cluster
    goes away while the client has a message in flight, which the loader reports itself (a
    WARNING or an error). Records about any other connection pass."""

    def __init__(self) -> None:
        super().__init__()
        self.comms: weakref.WeakSet[Any] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(arg is comm for arg in args for comm in list(self.comms))

    def watch(self, client: Any) -> None:
        """Drop such records about ``client``'s connection to its scheduler from now on."""
        logger = logging.getLogger("distributed.batched")
        if self not in logger.filters:
            logger.addFilter(self)
        comm = getattr(getattr(client, "scheduler_comm", None), "comm", None)
        if comm is not None:
            self.comms.add(comm)


_OWN_COMMS = _OwnCommClosed()


class PrepCluster:
    """The loader's connection to a preparation cluster (a ``distributed.Client`` of its own).

    Args:
        address: the scheduler, ``tcp://host:8786``.
        timeout_s: how long a batch may take on the cluster (and connecting may take) before the
            cluster counts as gone: then :class:`LoaderError`, or with ``fallback`` the batch
            (and every later one) is made by the loader's own threads.
        fallback: decode locally when the cluster is gone, instead of failing.
        retries: times a batch whose task failed on a worker is run again (a worker that dies
            while it holds a task is not a failure: the scheduler runs it elsewhere).
        security: ``prep_security`` (see :func:`make_security`): TLS with certificates.

    Raises:
        ConfigError: ``distributed`` is not installed, or the scheduler cannot be reached.
    """

    def __init__(
        self, address: str, *, timeout_s: float, fallback: bool, retries: int = 2, security: Any = None
    ) -> None:
        self.address, self.timeout_s, self.fallback, self.retries = address, timeout_s, fallback, retries
        self.security = make_security(security)
        self._lock = threading.Lock()
        self._gone_lock = threading.Lock()
        self.gone: str | None = None  # why the cluster counts as gone (fallback: local from then on)
        self._closer: threading.Thread | None = None  # closing the client of a cluster gone
        self.client: Any = self._new_client()  # a ConfigError here is the constructor's, not a fallback
        self.batches = 0  # made on the cluster
        self.local_batches = 0  # made locally after it went (fallback)

    def _connect(self) -> Any:
        """The client, connected now if it is not (a closed loader's next epoch reconnects).

        With ``fallback``, a failed connection marks the cluster gone before the lock is released,
        so the decode threads waiting for it do not each try again for ``timeout_s``."""
        with self._lock:
            if self.client is not None:
                return self.client
            if self.gone is not None:
                raise ConfigError(f"the preparation cluster at {self.address} is gone ({self.gone})")
            try:
                self.client = self._new_client()
            except ConfigError as exc:
                if self.fallback:
                    self._note_gone(exc)
                raise
            return self.client

    def _new_client(self) -> Any:
        Client = _distributed().Client
        if self.address.startswith("tls://") and self.security is None:
            import dask.config

            if not dask.config.get("distributed.comm.tls.ca-file", None):  # nor in dask's config
                raise ConfigError(
                    f"prep={self.address!r} is a TLS address and no certificates were given: pass "
                    "prep_security={'ca_file': ..., 'cert': ..., 'key': ...} (the trainer's "
                    "--prep-tls-ca-file, --prep-tls-cert, --prep-tls-key)"
                )
        try:
            client = Client(
                self.address, timeout=self.timeout_s, set_as_default=False, security=self.security
            )
        except (OSError, TimeoutError) as exc:
            # distributed's FatalCommClosedError: TLS refused, say; or the scheduler closing the
            # handshake on a certificate it does not trust (the client sees an SSL EOF).
            if type(exc).__name__ == "FatalCommClosedError" or "SSLEOFError" in str(exc):
                raise ConfigError(
                    f"prep={self.address!r}: the scheduler refused the connection: {exc} "
                    "(prep_security: the CA, certificate and key the cluster trusts)"
                ) from None
            raise ConfigError(
                f"prep={self.address!r}: cannot reach the preparation cluster's scheduler within "
                f"{self.timeout_s:g} s: {type(exc).__name__}: {exc}"
            ) from None
        _OWN_COMMS.watch(client)
        return client

    def decode(self, task: BatchTask, stop: threading.Event, spec: DecodeSpec, recipe: Recipe) -> Any:
        """Task ``task`` made into its batch on the cluster (what :func:`decode_batch` would
        return); ``None`` if ``stop`` was set meanwhile."""
        if self.gone is not None:
            return self._local(task, stop, spec)
        try:
            client = self._connect()  # after close(), again: the cluster may have gone meanwhile
        except ConfigError:
            if not self.fallback:
                raise
            return self._local(task, stop, spec)  # gone: _connect said so
        future = client.submit(
            prepare_batch,
            recipe,
            task,
            code_identity(recipe.transform),
            key=f"lakeshard-batch-{uuid.uuid4().hex}",
            retries=self.retries,
            pure=False,
        )
        began = time.monotonic()
        # Wait on an event the future sets when it is done, not on ``future.result(timeout=...)``:
        # distributed's synchronous wait with a timeout can fail (UnboundLocalError in
        # ``distributed.utils.sync``) when the result arrives as the timeout fires.
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        try:
            while not done.wait(_POLL_S):
                if stop.is_set():
                    _cancel(future)
                    return None
                if time.monotonic() - began > self.timeout_s:
                    raise TimeoutError(f"no batch back after {self.timeout_s:g} s")
            reply = pickle.loads(future.result())
        except Exception as exc:
            _cancel(future)
            if isinstance(exc, LoaderError):  # a bad row or a failed transform, on the worker
                raise
            return self._gone(exc, task, stop, spec)
        if isinstance(reply, str):  # a worker's refusal (see prepare_batch): a configuration error
            raise ConfigError(reply)
        batch, skipped = reply
        spec.skipped.extend(skipped)
        self.batches += 1
        if spec.tally is not None:
            spec.tally.add(len(task.images), 0.0, 0.0)
        return pinned(batch) if spec.pin_memory else batch

    def _gone(self, exc: BaseException, task: BatchTask, stop: threading.Event, spec: DecodeSpec) -> Any:
        if not self.fallback:
            raise LoaderError(
                f"{self._stopped(exc)}; pass prep_fallback=True to decode on this node instead"
            ) from exc
        self._note_gone(exc)
        return self._local(task, stop, spec)

    def _stopped(self, exc: BaseException) -> str:
        said = " ".join(str(exc).split())  # one line: distributed's messages have several
        why = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
        return f"the preparation cluster at {self.address} stopped making batches ({why})"

    def _note_gone(self, exc: BaseException) -> None:
        """The cluster is gone from now on (fallback): one WARNING, whichever thread saw it first,
        and its client closed at once, on a thread of its own (a caller may hold the lock
        :meth:`close` takes): left open, the client tries to reconnect and, a minute on, logs an
        ERROR of its own in the middle of a run that goes on well."""
        with self._gone_lock:
            if self.gone is None:
                self.gone = self._stopped(exc)
                log.warning("%s: decoding on this node from now on (prep_fallback=True)", self.gone)
                self._closer = threading.Thread(target=self.close, name="lakeshard-prep-close", daemon=True)
                self._closer.start()

    def _local(self, task: BatchTask, stop: threading.Event, spec: DecodeSpec) -> Any:
        self.local_batches += 1
        return decode_batch(task, stop, spec)

    def close(self) -> None:
        """Close the client (its threads); a later :meth:`decode` connects again. Waits for a
        close begun when the cluster went (:meth:`_note_gone`)."""
        closer = self._closer
        if closer is not None and closer is not threading.current_thread():
            closer.join(timeout=10)
        with self._lock:
            client, self.client = self.client, None
        if client is None:
            return
        # Quiet while closing: a client whose scheduler went away logs the tracebacks of its
        # reconnect task as that is cancelled; the loader has said what happened (a WARNING or an
        # error). Records of other clients in this process logged meanwhile are dropped too.
        quiet, loggers = _Quiet(), [logging.getLogger(name) for name in _QUIET_LOGGERS]
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            client.close(timeout=5)
        except Exception as exc:  # a cluster already gone: nothing to close
            log.debug("closing the preparation cluster's client: %s", exc)
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)


def _cancel(future: Any) -> None:
    """Cancel ``future``; a client whose cluster is gone may have closed its event loop
    already (distributed raises ``RuntimeError: IOLoop is closed``): nothing is left to cancel."""
    try:
        future.cancel()
    except Exception as exc:
        log.debug("cancelling %s: %s", getattr(future, "key", future), exc)
