//! baton lab (under construction).
