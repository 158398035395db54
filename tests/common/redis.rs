//! Starts a throwaway redis-server on a free port. Owned by the Lua work.
