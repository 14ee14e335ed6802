#!/usr/bin/env bash
# Makes sure PostgreSQL answers on 127.0.0.1:5432 to user postgres without a password and has a
# database `test` (what the postgres tests use). Starts the machine's own server if it is only
# stopped; installs one from Debian's packages if there is none. Trust auth is for loopback only.
set -euo pipefail

connects() { psql -h 127.0.0.1 -p 5432 -U postgres -d postgres -tAc 'select 1' >/dev/null 2>&1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if connects; then
  echo "ci: PostgreSQL answers on 127.0.0.1:5432"
else
  if ! command -v psql >/dev/null || ! ls -d /etc/postgresql/*/main >/dev/null 2>&1; then
    echo "ci: installing PostgreSQL from Debian's packages"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  hba=/etc/postgresql/$version/main/pg_hba.conf
  if ! as_root grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  if pg_isready -q -h 127.0.0.1 -p 5432; then
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload
  else
    echo "ci: starting PostgreSQL $version"
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
  fi
  for _ in $(seq 1 30); do connects && break; sleep 1; done
  connects || { echo "ci: cannot connect to PostgreSQL on 127.0.0.1:5432 as postgres" >&2; exit 1; }
fi

if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc "select 1 from pg_database where datname = 'test'" | grep -q 1; then
  createdb -h 127.0.0.1 -U postgres test
fi
echo "ci: database test is ready"
