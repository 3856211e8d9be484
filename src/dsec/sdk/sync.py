"""The sync API, generated from the async one (one implementation, no copied methods).

A single daemon thread per process runs an asyncio event loop (:class:`LoopThread`);
each sync call submits the corresponding coroutine there and blocks for its result.
:func:`synchronize` builds a sync class from an async class by walking its attributes:

=================================  ==============================================
async attribute                    sync attribute
=================================  ==============================================
``async def m(...)``               ``def m(...)`` returning the awaited result
``async def`` generator            ``def`` returning a plain iterator
classmethod / staticmethod         same kind, sync
property                           property
``__aenter__`` / ``__aexit__``     ``__enter__`` / ``__exit__``
=================================  ==============================================

Results that are instances of a synchronized async class (``AsyncSandbox``,
``AsyncCommands``, ...), or lists of them, come back wrapped in their sync class. Signatures and
docstrings are copied, so ``help(Sandbox.create)`` shows the real parameters.

Callbacks passed to sync methods (``on_stdout=``) run on the loop thread. Calling the sync
API from inside that loop (i.e. from such a callback) raises ``RuntimeError``: use the async
API there. Type checkers see the sync classes as dynamic (attribute access is ``Any``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = ["LoopThread", "SyncWrapper", "runner", "synchronize"]

T = TypeVar("T")


class LoopThread:
    """An event loop running forever in a daemon thread, restarted after ``fork()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = -1

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, started on first use."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid() or not self._loop.is_running():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def _run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=_run, name="dsec-sync-loop", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and return its result (or raise its exception)."""
        loop = self.loop()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "the sync dsec API was called from its own event loop; use the async API"
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # Ctrl-C while waiting: stop the work on the loop too
            raise


runner = LoopThread()
"""The process-wide loop thread used by every sync wrapper."""

_SYNC_OF: dict[type, type[SyncWrapper]] = {}

HANDWRITTEN: dict[type, frozenset[str]] = {}
"""Per generated sync class, the attributes it defined itself (the rest were generated)."""


def _wrap(value: Any) -> Any:
    sync_cls = _SYNC_OF.get(type(value))
    if sync_cls is not None:
        return sync_cls._from_impl(value)
    if isinstance(value, list) and any(type(v) in _SYNC_OF for v in value):
        return [_wrap(v) for v in value]  # e.g. AsyncSandbox.fork -> list[Sandbox]
    return value


def _unwrap(value: Any) -> Any:
    return value._impl if isinstance(value, SyncWrapper) else value


def _args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return tuple(_unwrap(a) for a in args), {k: _unwrap(v) for k, v in kwargs.items()}


class _DynamicClass(type):
    """Lets type checkers accept any class attribute of a generated sync class."""

    def __getattr__(cls, name: str) -> Any:
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


class SyncWrapper(metaclass=_DynamicClass):
    """Base of generated sync classes; ``_impl`` is the wrapped async object."""

    _impl: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            f"{type(self).__name__} objects come from the API (e.g. Sandbox.create() or "
            "Sandbox.connect(id)); they are not constructed directly"
        )

    @classmethod
    def _from_impl(cls, impl: Any) -> Any:
        obj = cls.__new__(cls)
        obj._impl = impl
        return obj

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return repr(self._impl).replace(type(self._impl).__name__, type(self).__name__, 1)


def _sync_coroutine(fn: Callable[..., Any], bind: Callable[[Any], Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self_or_cls: Any, *args: Any, **kwargs: Any) -> Any:
        a, kw = _args(args, kwargs)
        return _wrap(runner.run(fn(bind(self_or_cls), *a, **kw)))

    return method


def _sync_generator(fn: Callable[..., Any], bind: Callable[[Any], Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self_or_cls: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        a, kw = _args(args, kwargs)
        agen = fn(bind(self_or_cls), *a, **kw)

        async def _next() -> Any:
            return await agen.__anext__()

        def iterate() -> Iterator[Any]:
            try:
                while True:
                    try:
                        item = runner.run(_next())
                    except StopAsyncIteration:
                        return
                    yield _wrap(item)
            finally:
                runner.run(agen.aclose())

        return iterate()

    return method


def _sync_plain(fn: Callable[..., Any], bind: Callable[[Any], Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def method(self_or_cls: Any, *args: Any, **kwargs: Any) -> Any:
        a, kw = _args(args, kwargs)
        return _wrap(fn(bind(self_or_cls), *a, **kw))

    return method


def _sync_static(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def function(*args: Any, **kwargs: Any) -> Any:
        a, kw = _args(args, kwargs)
        result = fn(*a, **kw)
        if inspect.iscoroutine(result):
            result = runner.run(result)
        return _wrap(result)

    return function


def _convert(fn: Callable[..., Any], bind: Callable[[Any], Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(fn):
        return _sync_generator(fn, bind)
    if inspect.iscoroutinefunction(fn):
        return _sync_coroutine(fn, bind)
    return _sync_plain(fn, bind)


def synchronize(async_cls: type) -> Callable[[type[SyncWrapper]], type[SyncWrapper]]:
    """Class decorator: fill a :class:`SyncWrapper` subclass with sync versions of
    ``async_cls``'s public attributes (see the module docstring)."""

    def decorate(sync_cls: type[SyncWrapper]) -> type[SyncWrapper]:
        _SYNC_OF[async_cls] = sync_cls
        HANDWRITTEN[sync_cls] = frozenset(sync_cls.__dict__)
        seen: set[str] = set()
        for klass in async_cls.__mro__:
            if klass is object:
                continue
            for name, raw in vars(klass).items():
                if name in seen or (
                    name.startswith("_") and name not in ("__aenter__", "__aexit__")
                ):
                    continue
                seen.add(name)
                if name in sync_cls.__dict__:
                    continue  # hand-written override
                if name == "__aenter__":
                    sync_cls.__enter__ = _enter  # type: ignore[attr-defined]
                elif name == "__aexit__":
                    sync_cls.__exit__ = _exit  # type: ignore[attr-defined]
                elif isinstance(raw, classmethod):
                    conv = _convert(raw.__func__, lambda _cls: async_cls)
                    setattr(sync_cls, name, classmethod(conv))
                elif isinstance(raw, staticmethod):
                    setattr(sync_cls, name, staticmethod(_sync_static(raw.__func__)))
                elif isinstance(raw, property):
                    assert raw.fget is not None
                    setattr(
                        sync_cls, name, property(_sync_plain(raw.fget, _unwrap), doc=raw.__doc__)
                    )
                elif callable(raw):
                    setattr(sync_cls, name, _convert(raw, _unwrap))
        if not sync_cls.__doc__ or sync_cls.__doc__ == SyncWrapper.__doc__:
            sync_cls.__doc__ = async_cls.__doc__
        return sync_cls

    return decorate


def _enter(self: SyncWrapper) -> Any:
    runner.run(self._impl.__aenter__())
    return self


def _exit(self: SyncWrapper, exc_type: Any, exc: Any, tb: Any) -> Any:
    return runner.run(self._impl.__aexit__(exc_type, exc, tb))
