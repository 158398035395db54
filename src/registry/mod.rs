//! Registry: who owns which rig. Embedded (standalone) and Redis backends.
pub mod scripts;
