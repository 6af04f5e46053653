"""The loader's options, each defined once: its name, type, default, help text and check.

``ShardLoader`` and ``MixedLoader`` take every option as a keyword-only parameter of its own
(``ShardLoader(ds, batch_size=64, cache_dir="/cache")``), or the options in groups, or all at
once (``options=``):

- the common ones, fields of :class:`LoaderOptions` itself: ``channel``, ``rank``,
  ``world_size``, ``batch_size``, ``shuffle``, ``seed``, ``drop_last``, ``remainder``,
  ``shuffle_window``, ``num_threads``, ``prefetch``, ``pin_memory``, ``skip_bad_rows``;
- ``reads=`` :class:`RemoteReads`: ``read_concurrency``, ``memory_budget``, ``cache_dir``,
  ``cache_limit``;
- ``decoding=`` :class:`Decoding`: ``decoder``, ``transform``, ``augment``, ``crop``,
  ``normalize``;
- ``preparation=`` :class:`Preparation`: ``prep``, ``prep_timeout``, ``prep_fallback``,
  ``prep_security``;
- ``cost=`` :class:`Cost`: ``prices``, ``cost_budget``, ``on_budget``.

An option goes either by itself or in its group, not both (a :class:`ConfigError` naming it).
:data:`OPTIONS` is the table of them all (:class:`~loaders.options.table.Option`: name, group,
type, default, help, check, flag); the trainer's and the doctor's flags and YAML keys are made
from it (:mod:`loaders.options.flags`). What ``read_concurrency`` sets (the reads in flight,
their threads, the footers read at once, the parts of a first read, the read-ahead) is derived in
one place, :meth:`ReadPlan.of`.

Modules: :mod:`~loaders.options.table` (an option's definition, a row of the table),
:mod:`~loaders.options.values` (each option's check), :mod:`~loaders.options.groups` (the
groups), :mod:`~loaders.options.read_plan` (:class:`ReadPlan`),
:mod:`~loaders.options.loader_options` (:class:`LoaderOptions`, :data:`OPTIONS`) and
:mod:`~loaders.options.flags` (a command's flags).
"""

from loaders.options.flags import (
    check_loader_flags,
    from_loader,
    loader_flag_names,
    loader_flags,
    loader_values,
)
from loaders.options.groups import (
    DEFAULT_READ_CONCURRENCY,
    GROUPS,
    Cost,
    Decoding,
    Normalize,
    Preparation,
    RemoteReads,
)
from loaders.options.loader_options import (
    KEYWORDS,
    OPTIONS,
    ORDER_KEYS,
    LoaderOptions,
    default_threads,
    option_default,
)
from loaders.options.read_plan import ReadPlan
from loaders.options.table import DEFAULT, Option

__all__ = [
    "DEFAULT",
    "DEFAULT_READ_CONCURRENCY",
    "GROUPS",
    "KEYWORDS",
    "OPTIONS",
    "ORDER_KEYS",
    "Cost",
    "Decoding",
    "LoaderOptions",
    "Normalize",
    "Option",
    "Preparation",
    "ReadPlan",
    "RemoteReads",
    "check_loader_flags",
    "default_threads",
    "from_loader",
    "loader_flag_names",
    "loader_flags",
    "loader_values",
    "option_default",
]
