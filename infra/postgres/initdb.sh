#!/bin/sh
# Runs once, when the PostgreSQL data directory is empty (docker-entrypoint-initdb.d).
# One role per user of the database, each owning only its own databases:
#   temporal  -> temporal, temporal_visibility (Temporal's persistence and its SQL advanced visibility)
#   durastack -> durastack                     (the store: ledger, decision log, ps read model)
set -eu
: "${TEMPORAL_DB_PASSWORD:?}" "${STORE_DB_PASSWORD:?}"

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
     -v temporal_pw="$TEMPORAL_DB_PASSWORD" -v store_pw="$STORE_DB_PASSWORD" <<'SQL'
CREATE ROLE temporal LOGIN PASSWORD :'temporal_pw';
CREATE DATABASE temporal OWNER temporal;
CREATE DATABASE temporal_visibility OWNER temporal;
CREATE ROLE durastack LOGIN PASSWORD :'store_pw';
CREATE DATABASE durastack OWNER durastack;
SQL
