"""``python -m loaders.train``: see :mod:`loaders.train`."""

from loaders.train.loop import main

raise SystemExit(main())
