"""Every path is a URI: a local path, ``file://``, ``s3://``, ``gs://`` or ``az://``; each scheme
is a store.

A store (:class:`Store`) is the one small protocol the platform reads and writes through:
names (``normalize``, ``path``, ``uri``, its fsspec ``filesystem`` for listings and Arrow),
reads (``read``: a whole object or a byte range; ``read_tail``; ``get``: the bytes with their
ETag), atomic and conditional writes, removal, rename. :func:`store_for` picks a URI's store by
its scheme, in one table (:func:`register_store` adds one): :class:`LocalStore` for a path or
``file://``, :class:`S3Store` for ``s3://``, :class:`GCSStore` for ``gs://``,
:class:`AzureStore` for ``az://`` (design/0036, 0041, 0042).

The functions below (:func:`read_bytes`, :func:`write_bytes_atomic`, :func:`create_if_absent`,
...) take a URI and call its store; :func:`normalize`, :func:`is_local`, :func:`join` and the
other names of a URI ask the same table. S3 settings come from the standard AWS environment
(:func:`s3_options`), GCS settings from Google's (:func:`gcs_options`), Azure settings from
Azure's (:func:`azure_settings`); nothing here logs or returns credentials.

Modules: ``_store.py`` (the protocol, what reads return, request counts), ``_registry.py`` (the
table and the names), ``_local.py``, ``_s3.py``, ``_gcs.py`` and ``_azure.py`` (the stores), ``_ops.py`` (the
functions by URI).
"""

from lakeshard.storage._azure import (
    AzureSettings,
    AzureStore,
    azure_client,
    azure_settings,
    clear_azure_clients,
)
from lakeshard.storage._gcs import GCSStore, clear_gcs_clients, gcs_client, gcs_options
from lakeshard.storage._local import LocalStore, temp_sibling
from lakeshard.storage._ops import (
    GONE,
    cat,
    create_if_absent,
    exists,
    modified_utc,
    move,
    read_bytes,
    read_json,
    read_listed,
    remove,
    remove_if_unchanged,
    remove_temporaries,
    replace,
    replace_if_unchanged,
    write_bytes_atomic,
    write_json_atomic,
)
from lakeshard.storage._registry import (
    bucket,
    filesystem,
    from_listing,
    is_local,
    is_uri,
    join,
    local_path,
    normalize,
    register_store,
    scheme,
    store_for,
    unregister_store,
)
from lakeshard.storage._s3 import CLIENT_CONNECTIONS, S3Store, clear_s3_clients, s3_client, s3_options
from lakeshard.storage._store import Blob, RequestCounts, RequestStats, Store, Tail

__all__ = [
    "CLIENT_CONNECTIONS",
    "GONE",
    "AzureSettings",
    "AzureStore",
    "Blob",
    "GCSStore",
    "LocalStore",
    "RequestCounts",
    "RequestStats",
    "S3Store",
    "Store",
    "Tail",
    "azure_client",
    "azure_settings",
    "bucket",
    "cat",
    "clear_azure_clients",
    "clear_gcs_clients",
    "clear_s3_clients",
    "create_if_absent",
    "exists",
    "filesystem",
    "from_listing",
    "gcs_client",
    "gcs_options",
    "is_local",
    "is_uri",
    "join",
    "local_path",
    "modified_utc",
    "move",
    "normalize",
    "read_bytes",
    "read_json",
    "read_listed",
    "register_store",
    "remove",
    "remove_if_unchanged",
    "remove_temporaries",
    "replace",
    "replace_if_unchanged",
    "s3_client",
    "s3_options",
    "scheme",
    "store_for",
    "temp_sibling",
    "unregister_store",
    "write_bytes_atomic",
    "write_json_atomic",
]
