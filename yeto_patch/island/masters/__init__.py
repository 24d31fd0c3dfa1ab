"""masters"""
