# FindGloo: Gloo (https://github.com/facebookincubator/gloo) with its TCP
# transport, as Debian/Ubuntu's libgloo-dev installs it.
#
# Defines Gloo_FOUND, Gloo_VERSION and the imported target Gloo::gloo.
# Set Gloo_ROOT to look in another prefix first.
#
# Debian's own GlooConfig.cmake names its target plain `gloo` and registers a
# RelWithDebInfo build only, so we locate the header and library directly.

find_path(Gloo_INCLUDE_DIR NAMES gloo/config.h)
find_library(Gloo_LIBRARY NAMES gloo)

if(Gloo_INCLUDE_DIR AND EXISTS "${Gloo_INCLUDE_DIR}/gloo/config.h")
  file(STRINGS "${Gloo_INCLUDE_DIR}/gloo/config.h" _gloo_version_lines REGEX "#define GLOO_VERSION_(MAJOR|MINOR|PATCH) ")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define GLOO_VERSION_${_part} ([0-9]+).*" "\\1" _gloo_${_part} "${_gloo_version_lines}")
  endforeach()
  set(Gloo_VERSION "${_gloo_MAJOR}.${_gloo_MINOR}.${_gloo_PATCH}")
  # Our communicator needs the TCP transport; a build of Gloo without it is no use.
  file(STRINGS "${Gloo_INCLUDE_DIR}/gloo/config.h" Gloo_HAS_TCP REGEX "#define GLOO_HAVE_TRANSPORT_TCP 1")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Gloo
  REQUIRED_VARS Gloo_LIBRARY Gloo_INCLUDE_DIR Gloo_HAS_TCP
  VERSION_VAR Gloo_VERSION)

if(Gloo_FOUND AND NOT TARGET Gloo::gloo)
  add_library(Gloo::gloo UNKNOWN IMPORTED)
  set_target_properties(Gloo::gloo PROPERTIES
    IMPORTED_LOCATION "${Gloo_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Gloo_INCLUDE_DIR}")
endif()
mark_as_advanced(Gloo_INCLUDE_DIR Gloo_LIBRARY)
