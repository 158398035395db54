//! Lua registry scripts (lua/*.lua) and their typed EVALSHA wrappers. Owned by the Lua work.
