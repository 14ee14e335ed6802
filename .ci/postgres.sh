#!/usr/bin/env bash
# Makes sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth for local TCP and a
# database `test` (what the postgres tests use). Starts the machine's own server if it is only
# stopped; installs one from Debian's packages if there is none.
set -euo pipefail

answers() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v pg_isready >/dev/null || ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  echo "ci: installing PostgreSQL from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi

if ! answers; then
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba=/etc/postgresql/$version/main/pg_hba.conf
  # Trust for loopback TCP only, put first so it wins; this is a throwaway CI server.
  if ! as_root grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  echo "ci: starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  for _ in $(seq 1 30); do answers && break; sleep 1; done
fi
answers || { echo "ci: PostgreSQL does not answer on 127.0.0.1:5432" >&2; exit 1; }

if ! psql -h 127.0.0.1 -U postgres -tAc "select 1 from pg_database where datname = 'test'" | grep -q 1; then
  createdb -h 127.0.0.1 -U postgres test
fi
echo "ci: PostgreSQL answers on 127.0.0.1:5432, database test"
