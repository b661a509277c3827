"""Layer 2: claim stores (:mod:`.claimstore` file and :mod:`.s3store` S3, one async get/put and
one rule for store errors) and the daemons' local SQLite journals (:mod:`.journal`)."""
