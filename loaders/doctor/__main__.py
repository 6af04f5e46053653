"""``python -m loaders.doctor``: see :mod:`loaders.doctor`."""

from loaders.doctor.command import main

raise SystemExit(main())
