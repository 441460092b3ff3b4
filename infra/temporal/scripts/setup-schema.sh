#!/bin/sh
# Temporal's schemas on PostgreSQL, for the temporalio/admin-tools image. Safe to run on every start:
# setup-schema -v 0.0 only adds the version tables when they are missing, and update-schema applies only
# the versions newer than the database's. The databases themselves are created by infra/postgres/initdb.sh.
set -eu
: "${POSTGRES_SEEDS:?}" "${POSTGRES_USER:?}" "${SQL_PASSWORD:?}"

schema() {  # schema DATABASE DIR
    temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "${DB_PORT:-5432}" -u "$POSTGRES_USER" \
        --db "$1" setup-schema -v 0.0
    temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "${DB_PORT:-5432}" -u "$POSTGRES_USER" \
        --db "$1" update-schema -d "/etc/temporal/schema/postgresql/v12/$2/versioned"
}

schema "${DBNAME:-temporal}" temporal
# The v12 visibility schema is SQL advanced visibility: custom search attributes without Elasticsearch.
schema "${VISIBILITY_DBNAME:-temporal_visibility}" visibility
echo "temporal schemas are up to date"
