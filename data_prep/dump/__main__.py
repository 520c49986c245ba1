"""``python -m data_prep.dump`` (and ``torchrun -m data_prep.dump``): the ``eagle3-dump`` command."""

from data_prep.dump.cli import main

main()
