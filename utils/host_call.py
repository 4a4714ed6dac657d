"""A host function called from inside a compiled program: through XLA's FFI on a CPU, ``jax.pure_callback`` elsewhere.

``host_call(fn, result, *args)`` -> ``fn(*args)`` as an array of ``result``'s shape and dtype, where the program runs.

Why not ``jax.pure_callback`` on a CPU: there, a program that holds any of JAX's Python callbacks (``pure_callback``,
``io_callback``, ``buffer_callback``) leaves JAX's C++ dispatch and runs synchronously (its call returns only when the
program has ended, so the host cannot dispatch the next call while this one runs), is never written to JAX's
compilation cache, and puts every callback's arguments on a device as jax Arrays before the function sees them
(about 0.3 ms a callback). An FFI custom call is an ordinary op to JAX: the program dispatches asynchronously, is
cached, and the function reads XLA's buffers in place and writes its answer into the result's.

How: one FFI handler (``TARGET``, registered once a process) made by ctypes over XLA's FFI C API
(``jax.ffi.include_dir()``'s ``xla/ffi/api/c_api.h``: the call frame, its buffers, the metadata query, errors). The
program passes the function's key as a last int32 operand; the handler finds the function by its key (``register``:
keys count from 1 in a process, so that the same program lowered in a new process is the same text and its cached
executable is found) and calls it with the GIL held (ctypes takes it). The function gets numpy views of the
arguments, valid during the call only (it must copy what it keeps); an exception it raises, an answer of another
shape, a function gone (its key's weak reference dead) become the call's error (an ``XlaRuntimeError`` where the
program's result is read), never a crash. Only ``DTYPES`` travel.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import weakref
from ctypes import POINTER, Structure, c_char_p, c_int, c_int64, c_size_t, c_uint32, c_void_p
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

logger = logging.getLogger("flan_t5")
TARGET = "flan_t5_host_call"
DTYPES = {1: np.bool_, 2: np.int8, 4: np.int32, 5: np.int64, 6: np.uint8, 8: np.uint32, 11: np.float32}
# (XLA_FFI_DataType -> numpy)
_API_VERSION = (0, 1)  # the FFI C API's version the structures below follow (XLA supports it: c_api.h)
_METADATA = 1  # XLA_FFI_Extension_Metadata
_INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class _Extension(Structure):
    _fields_ = [("struct_size", c_size_t), ("type", c_int), ("next", c_void_p)]


class _Version(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("major", c_int), ("minor", c_int)]


class _Metadata(Structure):
    _fields_ = [("struct_size", c_size_t), ("api_version", _Version), ("traits", c_uint32),
                ("state_type_id", c_int64)]


class _MetadataExtension(Structure):
    _fields_ = [("base", _Extension), ("metadata", POINTER(_Metadata))]


class _Sequence(Structure):  # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64),
                ("types", POINTER(c_int)), ("items", POINTER(c_void_p))]


class _Attrs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("size", c_int64), ("types", c_void_p),
                ("names", c_void_p), ("attrs", c_void_p)]


class _Frame(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", POINTER(_Extension)), ("api", c_void_p),
                ("ctx", c_void_p), ("stage", c_int), ("args", _Sequence), ("rets", _Sequence), ("attrs", _Attrs),
                ("future", c_void_p)]


class _Buffer(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("dtype", c_int), ("data", c_void_p),
                ("rank", c_int64), ("dims", POINTER(c_int64))]


class _ErrorArgs(Structure):
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("message", c_char_p), ("errc", c_int)]


class _Api(Structure):  # its first fields, up to XLA_FFI_Error_Create
    _fields_ = [("struct_size", c_size_t), ("extension_start", c_void_p), ("api_version", _Version),
                ("internal_api", c_void_p), ("error_create", c_void_p)]


_ERROR_CREATE = ctypes.CFUNCTYPE(c_void_p, POINTER(_ErrorArgs))
_HANDLER = ctypes.CFUNCTYPE(c_void_p, POINTER(_Frame))

_lock = threading.Lock()
_functions: dict = {}  # key -> a weak (or, where none can be made, a strong) reference to the function
_keys: dict = {}  # id(function) -> key
_next = itertools.count(1)
_handler = None  # the ctypes function XLA calls (kept alive: XLA holds its address)


def register(fn: Callable) -> int:
    """The key ``host_call`` passes for ``fn``: one a function, counted from 1 in a process; held weakly where the
    function allows it (a dead function's calls fail)."""
    with _lock:
        key = _keys.get(id(fn))
        if key is not None and _functions[key]() is fn:
            return key
        key = next(_next)
        try:
            ref = weakref.ref(fn, lambda _, k=key, i=id(fn): _forget(k, i))
        except TypeError:
            ref = (lambda f: lambda: f)(fn)
        _functions[key], _keys[id(fn)] = ref, key
        return key


def _forget(key: int, ident: int) -> None:
    with _lock:
        _functions.pop(key, None)
        if _keys.get(ident) == key:
            del _keys[ident]


def _view(address: int) -> np.ndarray:
    """An XLA_FFI_Buffer as a numpy view of its memory."""
    buf = _Buffer.from_address(address)
    dtype = DTYPES.get(buf.dtype)
    if dtype is None:
        raise TypeError(f"a buffer of XLA data type {buf.dtype}: host_call passes {sorted(DTYPES)} only")
    shape = tuple(buf.dims[i] for i in range(buf.rank))
    n = 1
    for d in shape:
        n *= d
    if n == 0:
        return np.zeros(shape, dtype)
    raw = (ctypes.c_byte * (n * np.dtype(dtype).itemsize)).from_address(buf.data)
    return np.frombuffer(raw, dtype).reshape(shape)


def _error(frame, message: str) -> int:
    """An XLA_FFI_Error (XLA destroys it) carrying ``message``."""
    api = _Api.from_address(frame.api)
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs) - 4, None, message.encode("utf-8", "replace")[:2000], _INTERNAL)
    return _ERROR_CREATE(api.error_create)(ctypes.byref(args))


def _handle(frame_p):
    frame = frame_p.contents
    ext = frame.extension_start
    if ext and ext.contents.type == _METADATA:  # XLA asks which version of the API the handler speaks
        meta = ctypes.cast(ext, POINTER(_MetadataExtension)).contents.metadata.contents
        meta.api_version.major, meta.api_version.minor = _API_VERSION
        meta.traits = 0
        return None
    try:
        args = [_view(frame.args.items[i]) for i in range(frame.args.size)]
        out = _view(frame.rets.items[0])
        key = int(args.pop().reshape(-1)[0])  # (vmap broadcasts it with the others)
        fn = _functions.get(key, lambda: None)()
        if fn is None:
            raise RuntimeError(f"host_call: no function under key {key} (it was garbage collected: keep a reference "
                               "to it while its programs run)")
        for a in args:
            a.flags.writeable = False
        value = np.asarray(fn(*args))
        if value.shape != out.shape:
            raise ValueError(f"host_call: {getattr(fn, '__name__', type(fn).__name__)} answered shape "
                             f"{value.shape}, the program expects {out.shape}")
        out[...] = value
        return None
    except BaseException as e:  # noqa: BLE001 -- (an exception must not unwind through XLA's C frames)
        logger.error("a host call failed: %s: %s", type(e).__name__, e)
        return _error(frame, f"{type(e).__name__}: {e}")


def _registered() -> None:
    global _handler
    with _lock:
        if _handler is not None:
            return
        handler = _HANDLER(_handle)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [c_void_p, c_char_p, c_void_p]
        capsule = new(ctypes.cast(handler, c_void_p).value, b"xla._CUSTOM_CALL_TARGET", None)
        try:
            jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
        except Exception as e:  # noqa: BLE001 -- (elsewhere the CPU's branch is never lowered; on a CPU it fails there)
            logger.warning("host_call: the CPU's FFI handler was not registered: %s", e)
        _handler = handler


def host_call(fn: Callable, result: jax.ShapeDtypeStruct, *args, vmap_method: str = "broadcast_all") -> jax.Array:
    """``fn(*args)`` (numpy arrays in, an array of ``result``'s shape and dtype out) called from inside the program
    (see the module docstring): an FFI custom call on a CPU, ``jax.pure_callback`` on other platforms."""
    if np.dtype(result.dtype).type not in DTYPES.values() or any(np.dtype(a.dtype).type not in DTYPES.values()
                                                                  for a in args):
        raise TypeError(f"host_call passes {', '.join(np.dtype(t).name for t in DTYPES.values())} only")
    _registered()
    key = register(fn)

    def cpu(*a):
        return jax.ffi.ffi_call(TARGET, result, vmap_method=vmap_method)(*a, jnp.int32(key))

    def other(*a):
        return jax.pure_callback(fn, result, *a, vmap_method=vmap_method)

    return lax.platform_dependent(*args, cpu=cpu, default=other)
