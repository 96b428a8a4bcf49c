"""The ``os`` layer of the disk tier: what the stores ask of the operating system.

Nothing here knows what a store or a record is; every module is a thin, checked wrapper
of a system facility the backends share (in RocksDB's manner, where OS access goes
through ``env/``):

==============  ===========================================================================
files.py        owner-only directories and files whatever the umask, directory fsync
libc.py         ``fallocate`` (punch holes, allocate blocks), ``cachestat`` (what the page
                cache holds), page-aligned buffers for ``O_DIRECT``
preadv.py       ``preadv`` until every buffer is full (any number of buffers)
fastread.py     a record's parts read and hashed in one call, natively where
                ``_fastread.c`` was built (the GIL released), else in Python
threads.py      thread pools started ahead of their first use; the CPUs this process may use
locks.py        a shared/exclusive lock; the store directories open in this process
at_exit.py      closing stores left open at interpreter exit, before thread pools stop
==============  ===========================================================================

Imports only ``errors`` and ``format`` (buffer views; the record layout and read statuses
the native helper is checked against). The modules are
imported where used: ``tiered_kv.storage.os`` itself loads none of them.
"""
