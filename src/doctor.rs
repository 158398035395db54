//! `fleetlink-fe doctor`: host readiness checks. Owned by the tuning work.
