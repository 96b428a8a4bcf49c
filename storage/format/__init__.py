"""The ``format`` layer of the disk tier: what is on disk, each format defined once.

==================  =======================================================================
record.py           the record: header layout, encoding, decoding and every check of a read;
                    record keys and metas; the buffer views reads and writes take
status.py           the verdicts of a native read (VERIFIED, SHORT, FAILED, UNCACHED)
rows.py             row scatter plans: where a batch of payloads lands in a few buffers
writer.py           who wrote a store: the description stores record beside their layout
sealed_level.py     the record that a level is sealed (encrypted), and the opener check
==================  =======================================================================

Imports only ``errors``. The C read helper (``storage/os/_fastread.c``) reads records in
this format: it exports the constants it was compiled with, and
:mod:`~tiered_kv.storage.os.fastread` uses it only if they are these.
"""
