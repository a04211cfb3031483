-- A published range's arrays are stored out of line but not compressed.
--
-- A range of 1,000 rows lists 1,000 outbox ids and 1,000 stream sequences (8 KB each), over the
-- 2 KB at which Postgres moves a value out of line, and by default it compresses such values with
-- pglz first. Measured on the relay's drain (docs/benchmarks.md, session 25), pglz was the largest
-- single item of Postgres' CPU there (17%). Inserting 2,000 such ranges took 3.98 s with pglz and
-- 1.19 s with EXTERNAL, which keeps them out of line without compressing them: 1.4 ms saved per
-- range, 1.4 µs per published row, for 16 KB per 1,000 rows instead of about 8 KB (retention
-- deletes ranges with their rows). Reading a row's sequence (the view handoff.outbox_delivery)
-- needs no decompression.
-- Changes only how new values are stored; existing ranges stay as they are.
ALTER TABLE handoff.published_range
    ALTER COLUMN outbox_ids SET STORAGE EXTERNAL,
    ALTER COLUMN stream_sequences SET STORAGE EXTERNAL,
    ALTER COLUMN duplicate_ids SET STORAGE EXTERNAL;
