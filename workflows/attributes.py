"""The keys of the search attributes the workflows set, one per name the server registers (SEARCH_ATTRIBUTES, in
that order): the service and group a replica workflow belongs to, the backend it ran on, its final status."""

from temporalio.common import SearchAttributeKey

from models.settings import SEARCH_ATTRIBUTES

SA_SERVICE, SA_GROUP, SA_BACKEND, SA_STATUS = (SearchAttributeKey.for_keyword(name) for name in SEARCH_ATTRIBUTES)
