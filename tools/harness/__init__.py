"""Process harnesses shared by ``tools/`` and ``tests/``: bounded waits (:mod:`.waiting`), the
crash matrix's job and trial (:mod:`.crash_job`, :mod:`.crash_trial`), and nodes as Linux
namespaces (:mod:`.netns`, processes forked into them in :mod:`.nodeprocs`, the crash matrix's
namespace hosts in :mod:`.netns_hosts`). They import ckptd and each other, never the ``tests`` package, so that
``tools/crash_matrix.py`` runs without the test suite."""
