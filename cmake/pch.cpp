// Translation unit that owns the shared precompiled header (see torch_pch.cmake).
